"""The `brigade` command: parse, build, call. Each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import json
import sys

from brigade.errors import BrigadeError


class Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def _model_arg(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--model", default=default,
                   help="gpt, resnet50, toy, mlp, or path/to/file.py:factory (default: %(default)s)")


def _add_schedule(sub) -> None:
    p = sub.add_parser("schedule", help="print a pipeline schedule's grid and bubble")
    p.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b or zb (default: %(default)s)")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_schedule)


def cmd_schedule(args: argparse.Namespace) -> int:
    from brigade.pipeline import schedule as sch

    plan = sch.build(args.schedule, args.stages, args.microbatches)
    sim = sch.simulate(plan, 1.0, 1.0)
    if args.json:
        print(json.dumps({
            "schedule": args.schedule, "stages": args.stages, "microbatches": args.microbatches,
            "bubble_fraction": sim.bubble_fraction, "makespan": sim.makespan,
            "plan": {str(r): [str(a) for a in acts] for r, acts in plan.items()},
        }))
    else:
        print(f"{args.schedule}: {args.stages} stages, {args.microbatches} micro-batches "
              "(unit forward and backward costs)")
        print(sch.render(plan))
    return 0


def _add_check(sub) -> None:
    p = sub.add_parser("check", help="compare a pipeline with a single device, loss and gradients")
    _model_arg(p, "gpt")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b or zb (default: %(default)s)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--runtime", default="process", choices=["process", "local"],
                   help="one process per stage, or one thread per device in this process")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--balance", default=None, help="blocks per stage, like 3,5 (default: by params)")
    p.add_argument("--balance-by", default="params", choices=["params", "time"],
                   help="without --balance: balance parameter counts or measured time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_check)


def cmd_check(args: argparse.Namespace) -> int:
    from brigade.check import CheckConfig, run_check
    from brigade.models.gpt import GPTConfig
    from brigade.pipeline.partition import parse_balance

    options = {"gpt_cfg": GPTConfig(block_size=32)} if args.model == "gpt" else {}
    if args.model == "resnet50":
        options = {"image_size": 32}
    cfg = CheckConfig(
        model=args.model, stages=args.stages, schedule=args.schedule,
        microbatches=args.microbatches, runtime=args.runtime, batch_size=args.batch_size,
        balance=parse_balance(args.balance) if args.balance else None, seed=args.seed,
        atol=args.atol, model_options=options, balance_by=args.balance_by,
    )
    result = run_check(cfg, port=args.port)[0]
    if args.json:
        print(json.dumps(result))
    else:
        verdict = "OK" if result["ok"] else "MISMATCH"
        print(f"{verdict}: {args.model} on {cfg.stages} stages ({cfg.runtime}), {cfg.schedule}, "
              f"m={cfg.microbatches}, balance {result['balance']}, reference: {result['reference']}")
        print(f"  max |Δloss| {result['max_abs_loss_diff']:.3g}   max |Δgrad| "
              f"{result['max_abs_grad_diff']:.3g}   max |Δparam| after one SGD step "
              f"{result['max_abs_param_diff']:.3g}   (tolerance {cfg.atol:g})")
    return 0 if result["ok"] else 1


def build_parser() -> Parser:
    parser = Parser(prog="brigade", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in (_add_schedule, _add_check):
        add(sub)
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
