"""`brigade bench` and `brigade tune`: their flags (what both sweep over, in `_sweep_args`) and
the commands, which `bench.run` carries out."""

from __future__ import annotations

import argparse

from brigade.config.fielddoc import MODELS


def model_arg(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--model", default=default,
                   help=f"the model to time: {MODELS.long()} (default: %(default)s)")



def add_bench(sub, json_arg) -> None:
    """`brigade bench`; `json_arg(parser)` adds --json (cli's)."""
    p = sub.add_parser("bench", help="time single device, model parallel, pipelines, torch's pipelining, DDP")
    model_arg(p, "resnet50")
    p.add_argument("--out", default="results/bench",
                   help="folder for the results' JSON and plots (default: %(default)s)")
    _sweep_args(p)
    p.add_argument("--ranks", type=int, default=2,
                   help="pipeline ranks, one process each (default: %(default)s); on a CPU with fewer "
                        "cores, they share them: --ranks 4 on 2 cores times pp 4, every schedule as slowed")
    p.add_argument("--malloc-defaults", action="store_true",
                   help="on CPU, leave malloc as it is (freed memory goes back to the OS), to see what "
                        "keeping it saves (brigade.host.malloc)")
    p.set_defaults(func=cmd_bench)


def _sweep_args(p: argparse.ArgumentParser) -> None:
    """What `bench` and `tune` both sweep over."""
    from brigade.pipeline.plans import schedule

    p.add_argument("--quick", action="store_true",
                   help="one split size (fewer configurations), the same number of timed rounds")
    p.add_argument("--batch-size", type=int, default=None,
                   help="samples per step (default: 32; resnet50 on 2 or more GPUs: 120)")
    p.add_argument("--image-size", type=int, default=None,
                   help="resnet50: side of the square images in pixels (default: 64; on 2 or more GPUs: 128)")
    p.add_argument("--repeats", type=int, default=None,
                   help="bench: timed rounds, each timing every configuration once (default 10); "
                        "tune: interleaved rounds in which its trials are timed together")
    p.add_argument("--splits", default=None,
                   help="split sizes (samples per micro-batch) to try, like 1,4,16 (default: the "
                        "tutorial's, scaled to the batch)")
    p.add_argument("--schedules", default=",".join(schedule.names()),
                   help=f"pipeline schedules to time, comma-separated, from {schedule.expected()} "
                        "(default: %(default)s)")
    p.add_argument("--compile", action="store_true",
                   help="compile each block on its own (torch.compile), as brigade train --compile "
                        "does: in every row and trial, torch's pipelining's too; the compiler runs in "
                        "the untimed warm-up")
    p.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")


def cmd_bench(args: argparse.Namespace) -> int:
    from brigade.bench.run import run_bench

    return run_bench(args)


def add_tune(sub, json_arg) -> None:
    """`brigade tune`; `json_arg(parser)` adds --json (cli's)."""
    p = sub.add_parser("tune", help="choose split size, schedule and balance; write a train config")
    model_arg(p, "resnet50")
    p.add_argument("--out", default="results/tune",
                   help="folder for the choice, its measurements and the train config it writes "
                        "(default: %(default)s)")
    p.add_argument("--verify", action="store_true", help="also time the full sweep, to compare")
    p.add_argument("--memory-per-device", default="0",
                   help="the most memory a process may hold at its peak, like 8GiB or 512MB; a "
                        "configuration predicted to need more is never chosen (default: no limit)")
    json_arg(p)
    _sweep_args(p)
    p.set_defaults(func=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> int:
    from brigade.bench.run import run_tune

    return run_tune(args)
