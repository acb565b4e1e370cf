"""The `brigade` command line."""

# Thin: parse, build, call. Each subcommand's work lives in its own module; a flag's help is the
# sentence of the config field it sets (`brigade.config.fielddoc`) wherever there is one.

from __future__ import annotations

import argparse
import json
import sys
import time
import typing
from pathlib import Path

from brigade.config.fielddoc import default_of, field_of, flag_help, sentence
from brigade.errors import BrigadeError

DESCRIPTION = """\
brigade trains PyTorch models with data, model and pipeline parallelism (GPipe, 1F1B,
zero-bubble, interleaved and V schedules), alone or combined, on CPUs with gloo or GPUs with
NCCL, on one machine or many. Runs survive faults and resume exactly; brigade also proves a
pipeline computes what one device does, and measures and tunes itself."""

FIRST_RUN = """\
a first run:
  brigade train                                  a small GPT on CPython's docs, 2 processes
  brigade train --nproc 2 --pp 2 --schedule zb   the same GPT on a 2-stage zero-bubble pipeline
  brigade schedule --schedule 1f1b --stages 4    draw a schedule's grid and bubble
  brigade check --model gpt --stages 2           prove a pipeline equals one device

brigade COMMAND --help lists a command's flags."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def _option(p: argparse.ArgumentParser, cls: type, name: str, **kw) -> None:
    """`--name` for field `name` of dataclass `cls`: its default and its sentence as the help
    (an int or float field's type, a bool field a switch — `--name / --no-name` where it is on
    by default —, unless `kw` says otherwise)."""
    f = field_of(cls, name)
    kind = typing.get_type_hints(cls)[name]
    kw.setdefault("default", default_of(f))
    if kind is bool:
        kw.setdefault("action", argparse.BooleanOptionalAction if kw["default"] else "store_true")
    else:
        kw.setdefault("type", kind if kind in (int, float) else None)
    p.add_argument("--" + name.replace("_", "-"), help=flag_help(f, kw["default"]), **kw)


def _json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _add_schedule(sub) -> None:
    from brigade.config import ParallelConfig

    p = sub.add_parser("schedule", help="print a pipeline schedule's grid and bubble")
    _option(p, ParallelConfig, "schedule")
    p.add_argument("--stages", type=int, default=4, help="pipeline depth in ranks (default: 4)")
    _option(p, ParallelConfig, "virtual")
    p.add_argument("--microbatches", type=int, default=8,
                   help="micro-batches in the step drawn (default: 8)")
    _json_arg(p)
    p.set_defaults(func=cmd_schedule)


def cmd_schedule(args: argparse.Namespace) -> int:
    from brigade.pipeline.plans.schedule import SCHEDULES, build, check
    from brigade.pipeline.plans.simulate import render, simulate

    sched = SCHEDULES[check(args.schedule)]
    virtual = sched.resolve_virtual(args.virtual)
    plan = build(args.schedule, args.stages, args.microbatches, virtual)
    sim = simulate(plan, 1.0, 1.0)
    if args.json:
        print(json.dumps({
            "schedule": args.schedule, "stages": args.stages, "microbatches": args.microbatches,
            "virtual": virtual, "placement": sched.placement,
            "bubble_fraction": sim.bubble_fraction, "makespan": sim.makespan,
            "peak_held": {str(s): n for s, n in sim.peak_held.items()},
            "plan": {str(r): [str(a) for a in acts] for r, acts in plan.items()},
        }))
    else:
        per_rank = f", {virtual} stages per rank ({sched.placement})" if virtual > 1 else ""
        print(f"{args.schedule}: {args.stages} ranks{per_rank}, {args.microbatches} micro-batches "
              "(unit forward and backward costs per stage; a cell is STAGE OP MICRO-BATCH)")
        print(render(plan))
        print("peak held per stage (micro-batches): "
              + " ".join(f"{s}:{n}" for s, n in sim.peak_held.items()))
    return 0


def _add_train(sub) -> None:
    from brigade import config

    p = sub.add_parser("train", help="train a model (default: GPT on CPython's docs, 2 processes)",
                       description="Flags override --config FILE.toml, which overrides the defaults.")
    config.add_flags(p)
    p.add_argument("--inject-fault", default=None, metavar="KIND:rank=R:step=S",
                   help="chaos testing: kill, stall or kill-during-snapshot, once, on the first attempt")
    p.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from brigade import config
    from brigade.config.resolve import degrees_of
    from brigade.launcher.agent import Stopped
    from brigade.launcher.env import launcher_world
    from brigade.snapshot.format import latest_step
    from brigade.train.faults import parse_fault
    from brigade.train.run import run

    if getattr(args, "lora", None) == 0:  # typed (flags left out are absent): 0 is no rank at all
        raise BrigadeError("--lora 0: the adapters' rank must be ≥ 1 (8 or 16 are usual); leave --lora "
                           "out to train every weight")
    cfg = config.build(args, world=launcher_world())  # under torchrun or srun, their world
    p = cfg.parallel
    fault = parse_fault(args.inject_fault, world=degrees_of(p).size or p.nproc * p.nnodes,
                        max_steps=cfg.train.max_steps) if args.inject_fault else None
    try:
        run(cfg, fault, port=args.port)
    except Stopped as stop:
        step = latest_step(cfg.train.out)
        print(f"brigade: stopped by {stop.signame}; newest snapshot: step {step}. "
              f"Run the same command to resume.", flush=True)
        return 0 if stop.signame == "SIGTERM" else 130
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a run's newest snapshot")
    p.add_argument("--from", dest="source", required=True,
                   help="a run folder (train's --out), for its newest good snapshot, or a snapshot folder")
    p.add_argument("--prompt", default="\n", help="text the sample starts with (default: a newline)")
    p.add_argument("--tokens", type=int, default=300,
                   help="tokens (characters) to sample after the prompt (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature: lower is more predictable, 1 samples the model as it "
                        "is (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the sampling: the same seed, the same text (default: %(default)s)")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from brigade.train.sample import main_generate

    return main_generate(args.source, args.prompt, args.tokens, args.seed, args.temperature)


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="write a run's weights back as a Hugging Face directory")
    p.add_argument("--hf", required=True, metavar="OUT",
                   help="the directory to write (new): config and tokenizer of the run's hf:DIR, "
                        "the trained weights as model.safetensors")
    p.add_argument("--from", dest="source", required=True,
                   help="a run folder (train's --out), for its newest good snapshot, or a snapshot folder")
    p.add_argument("--adapter", action="store_true",
                   help="a --lora run's adapters alone, as a PEFT adapter folder (adapter_config.json, "
                        "adapter_model.safetensors) for peft to load onto the run's hf:DIR; without "
                        "it, the whole model, the adapters merged into its weights")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from brigade.train.export import export

    print(f"brigade export: wrote {export(args.source, args.hf, args.adapter)}")
    return 0


def _add_plot(sub) -> None:
    p = sub.add_parser("plot", help="write loss.png for a run folder, finished or not")
    p.add_argument("run", help="a run folder (train's --out), finished or still running")
    p.set_defaults(func=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    from brigade.train.plot import plot_run

    if not Path(args.run).is_dir():
        raise BrigadeError(f"{args.run!r} is not a folder: give the --out folder of a training run")
    path = plot_run(args.run)
    print(f"wrote {path}" if path else f"{args.run}: no steps recorded yet, nothing to plot")
    return 0


def _add_tokenize(sub) -> None:
    from brigade.data.tokenize import TokenizeConfig

    p = sub.add_parser("tokenize", help="tokenize a corpus once into memory-mapped shards (train "
                                         "with --data OUT)")
    p.add_argument("corpus", nargs="+", help=sentence(TokenizeConfig, "corpus"))
    for name in ("model", "out", "field", "shard_tokens"):
        _option(p, TokenizeConfig, name)
    p.set_defaults(func=cmd_tokenize)


def cmd_tokenize(args: argparse.Namespace) -> int:
    from brigade.data.tokenize import TokenizeConfig, tokenize

    if not args.out:
        raise BrigadeError("--out is missing: give the folder to write the shards into")
    cfg = TokenizeConfig(corpus=args.corpus, model=args.model, out=args.out, field=args.field,
                         shard_tokens=args.shard_tokens)
    start = time.perf_counter()
    m = tokenize(cfg, progress=sys.stderr.isatty())
    print(f"brigade tokenize: {m.tokens:,} tokens, {m.documents:,} documents in {len(m.shards)} "
          f"shard(s) of {m.dtype} in {args.out}{' (with loss masks)' if m.masked else ''} "
          f"({time.perf_counter() - start:.1f} s): train with --model {args.model} --data {args.out}")
    return 0


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="verify a snapshot and print its step, layout and params_sha256")
    p.add_argument("path", help="a run folder (its newest good snapshot) or a snapshot folder")
    _json_arg(p)
    p.set_defaults(func=cmd_inspect)


def cmd_inspect(args: argparse.Namespace) -> int:
    from brigade.snapshot.format import resolve

    found = resolve(args.path)
    m = found.manifest
    info = {"path": str(found.path), "step": m.step, "layout": m.layout,
            "params_sha256": m.params_sha256, "config_hash": m.config_hash,
            "model": m.model, "files": len(m.files), "checksums": "ok"}
    if args.json:
        print(json.dumps(info))
    else:
        for k, v in info.items():
            print(f"{k:>14}: {v}")
    return 0


def _add_doctor(sub) -> None:
    from brigade.doctor import Setup

    p = sub.add_parser("doctor", help="check this machine (and the others) before a run: PASS or FAIL",
                       description="Run on every node with the flags you would give brigade train.")
    for name in ("nproc", "nnodes", "node_rank", "rdzv_endpoint", "local_addr", "backend", "out"):
        _option(p, Setup, name)
    _option(p, Setup, "port", type=int)
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from brigade import config
    from brigade.doctor import Setup, run_doctor

    cfg = config.RunConfig()  # checked as `brigade train` checks the same flags
    p = cfg.parallel
    p.nproc, p.nnodes, p.node_rank = args.nproc, args.nnodes, args.node_rank
    p.rdzv_endpoint, p.local_addr = args.rdzv_endpoint, args.local_addr
    config.validate(cfg)
    setup = Setup(args.nproc, args.nnodes, args.node_rank, args.rdzv_endpoint, args.local_addr,
                  args.backend, args.out, args.port)
    return 0 if run_doctor(setup) else 1


_DEBUG = "on an error, show the full traceback instead of one line"


def build_parser() -> Parser:
    parser = Parser(prog="brigade", description=DESCRIPTION, epilog=FIRST_RUN,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help=_DEBUG)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    from brigade.bench.command import add_bench, add_tune
    from brigade.check.command import add_check
    from brigade.planner.command import add_plan
    from brigade.train.evaluate import add_eval

    for add in (_add_train, _add_tokenize, _add_generate, lambda s: add_eval(s, _json_arg), _add_export,
                _add_plot, _add_inspect,
                _add_schedule, lambda s: add_check(s, _option, _json_arg),
                lambda s: add_bench(s, _json_arg), lambda s: add_tune(s, _json_arg),
                lambda s: add_plan(s, _option), _add_doctor):
        add(sub)
    for p in sub.choices.values():
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrigadeError as exc:
        if args.debug:
            raise
        sys.stderr.write(f"brigade {args.command}: error: {exc}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("brigade: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
