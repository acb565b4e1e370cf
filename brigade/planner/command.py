"""`brigade plan`'s flags (from PlanConfig's field docs) and the command itself."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path


def add_plan(sub, option) -> None:
    """The subcommand; `option(parser, cls, name)` adds a documented field's flag (cli._option)."""
    from brigade.config import ModelConfig
    from brigade.planner.config import PlanConfig

    p = sub.add_parser(
        "plan",
        help="predict step time, MFU and memory of every layout on a target cluster",
        description="Costs measured here, scaled to the target; the pipeline simulated.",
    )
    for f in fields(PlanConfig):
        option(p, PlanConfig, f.name)
    for name in ("n_layer", "n_head", "n_embd", "experts", "top_k"):
        option(p, ModelConfig, name)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from brigade.config import ModelConfig, to_toml
    from brigade.config.validate import experts
    from brigade.fsutil import write_atomic
    from brigade.planner.config import PlanConfig
    from brigade.planner.report import table
    from brigade.planner.run import model_config, plan, to_config

    cfg = PlanConfig(**{f.name: getattr(args, f.name) for f in fields(PlanConfig)})
    experts(args.experts, args.top_k, cfg.model)
    base = ModelConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, experts=args.experts,
                       top_k=args.top_k)
    result = plan(cfg, base)
    if cfg.write_config:
        fit = next((r for r in result["rows"] if r["fits"]), None)
        if fit is None:
            from brigade.errors import BrigadeError

            raise BrigadeError(
                "no layout fits the device's memory: nothing written; try --recompute full, "
                "a smaller batch or more devices"
            )
        run = to_config(cfg, fit, model_config(cfg, base), result["nodes"], result["per_node"])
        write_atomic(Path(cfg.write_config), to_toml(run))
        result["config_file"], result["chosen"] = cfg.write_config, fit["label"]
    if args.json:
        print(json.dumps(result))
    else:
        print(table(result, cfg.top))
        if cfg.write_config:
            print(f"wrote {cfg.write_config} ({result['chosen']}): brigade train --config {cfg.write_config}")
    return 0
