"""`brigade check`'s command line: its flags (a `CheckConfig` field each) and what it runs."""

from __future__ import annotations

import argparse
import json


def add_check(sub, option, json_arg) -> None:
    """`brigade check`'s flags, each with its `CheckConfig` field's sentence (`option`: the CLI's
    `_option`; `json_arg`: its --json)."""
    from brigade.check.run import CheckConfig

    p = sub.add_parser("check", help="compare a pipeline with a single device, loss and gradients")
    from brigade.config.recompute import MODES

    closed = {"runtime": ["process", "local"], "balance_by": ["params", "time"], "recompute": list(MODES)}
    for name in ("model", "stages", "schedule", "microbatches", "virtual", "dp", "shard", "tp", "ep", "cp",
                 "cp_method", "sequence_parallel", "reshard", "recompute", "compile", "float8", "runtime",
                 "devices", "chunked_loss", "loss_chunk",
                 "batch_size", "balance", "balance_by", "seed", "atol", "experts", "top_k", "lora",
                 "documents"):
        option(p, CheckConfig, name, **({"choices": closed[name]} if name in closed else {}))
    p.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    json_arg(p)
    p.set_defaults(func=cmd_check)


def cmd_check(args: argparse.Namespace) -> int:
    """Run the check the flags describe; its lines (or --json's object); 0 where it is equal."""
    from brigade.check import report
    from brigade.check.run import CheckConfig, run_check
    from brigade.config.validate import experts
    from brigade.models.gpt import GPTConfig
    from brigade.pipeline.stages.partition import parse_balance

    experts(args.experts, args.top_k, args.model)
    moe = {"experts": args.experts, "top_k": args.top_k} if args.experts else {}
    options = {"gpt_cfg": GPTConfig(block_size=32, **moe)} if args.model == "gpt" else {}
    if args.model == "resnet50":
        options = {"image_size": 32}
    cfg = CheckConfig(
        model=args.model, stages=args.stages, schedule=args.schedule,
        microbatches=args.microbatches, runtime=args.runtime, batch_size=args.batch_size,
        balance=parse_balance(args.balance) if args.balance else None, seed=args.seed,
        atol=args.atol, model_options=options, balance_by=args.balance_by,
        devices=[d.strip() for d in args.devices.split(",")] if args.devices else None,
        virtual=args.virtual, dp=args.dp, shard=args.shard, reshard=args.reshard,
        recompute=args.recompute, tp=args.tp, sequence_parallel=args.sequence_parallel,
        compile=args.compile, float8=args.float8, experts=args.experts, top_k=args.top_k, ep=args.ep,
        cp=args.cp, cp_method=args.cp_method, chunked_loss=args.chunked_loss, loss_chunk=args.loss_chunk,
        lora=args.lora, documents=args.documents,
    )
    result = run_check(cfg, port=args.port)[0]
    print(json.dumps(result) if args.json else "\n".join(report.lines(cfg, result)))
    return 0 if result["ok"] else 1
