"""Regenerate every file in results/ with the current code, then rewrite docs/results.md from them.

    python -m brigade.results                      # everything (about 25 minutes on 2 cores)
    python -m brigade.results --only overhead,restart
    python -m brigade.results --quick --out /tmp/r  # tiny sizes: tests this script, not brigade
    python -m brigade.results --table              # only print the table from the files
    python -m brigade.results --page               # only rewrite docs/results.md's blocks (page.py)

Benchmarks write their own JSON (`--out results/NAME`). Figures that only a training run
shows (loss, duration, snapshot seconds, restart and hang timing) are read from its
metrics.jsonl and output by the extractors here and written to results/train/ and
results/faults/. The two-host figures need root and network namespaces: `--only two-hosts`
says so and how to measure them; their files are kept as they are.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from brigade.errors import BrigadeError, RunError
from brigade.results import provenance
from brigade.train.metrics import events, loop_seconds, read_records, training, validation

TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--context", "32", "--block-size", "32",
        "--batch-size", "8", "--eval-batches", "1", "--sample-tokens", "0", "--warmup-steps", "2"]
TOY = "--model toy --batch-size 8 --splits 4,2 --repeats 1"
TOY_PP4 = "--model mlp --batch-size 8 --splits 2 --repeats 1 --schedules 1f1b,auto --ranks 4"
BRIGADE = [sys.executable, "-m", "brigade"]


@dataclass
class Job:
    """A command as docs/results.md shows it and, for training runs, what to read from it.

    `command` runs with `--out FOLDER` added (unless `takes_out` is False); `quick` is the same with
    tiny sizes, for tests. Without `extract`, the command writes its own JSON into the folder
    of results/`file`. With it, the command's --out is a temporary run folder, and
    `extract(run, output, exit_code, wall_s)` returns the figures written to results/`file`.
    """

    command: str
    file: str
    quick: str = ""
    extract: Callable[..., dict] | None = None
    expect_exit: int = 0
    needs_root: str = ""
    takes_out: bool = True  # False: the command has no --out (it prints its figures)

    def argv(self, quick: bool) -> list[str]:
        words = shlex.split(self.quick if quick and self.quick else self.command)
        if words[0] == "brigade":
            return [*BRIGADE, *words[1:]]
        return [sys.executable, *words[1:]] if words[0] == "python" else words


def _main(run: Path, output: str, code: int, wall_s: float) -> dict:
    recs = read_records(run)
    vals = [r["val_loss"] for r in validation(recs)]
    steps = training(recs)[-1]["step"]
    sample = (run / "sample.txt").read_text(encoding="utf-8") if (run / "sample.txt").is_file() else ""
    return {"val_loss_first": vals[0], "val_loss_last": vals[-1], "steps": steps, "wall_s": wall_s,
            "sample": sample[:300]}


def _snapshot(run: Path, output: str, code: int, wall_s: float) -> dict:
    recs = read_records(run)
    every = _toml_value(run / "config.toml", "snapshot_every")
    steps = training(recs)[-1]["step"]
    snaps = events(recs, "snapshot")
    return {"snapshot_s": [r["seconds"] for r in snaps if r["step"] < steps],  # periodic, in the background
            "final_s": snaps[-1]["seconds"], "snapshot_every": every,
            "step_s": statistics.median(loop_seconds(recs, skip=5)), "steps": steps}


def _toml_value(path: Path, key: str) -> int:
    m = re.search(rf"^{key} = (\d+)$", path.read_text(encoding="utf-8"), re.M)
    if m is None:
        raise RunError(f"{path} has no {key}: the run did not write its config")
    return int(m[1])


def _restart(run: Path, output: str, code: int, wall_s: float) -> dict:
    firsts = [r for r in events(read_records(run), "first_step") if r["attempt"] > 0]
    if not firsts:
        raise RunError(f"no restarted attempt in {run}/metrics.jsonl: the fault did not fire")
    r = firsts[-1]
    return {"attempt": r["attempt"], "resumed_from": r["resumed_from"],
            "first_step_s": r["seconds_from_process_start"], "wall_s": wall_s}


def _hang(run: Path, output: str, code: int, wall_s: float) -> dict:
    m = re.search(r"^\s+(\d+)\s.*?(\d+\.\d) s\s+<- stuck$", output, re.M)
    verdict = re.search(r"^verdict: (.*)$", output, re.M)
    if m is None or verdict is None:
        raise RunError("the hang report (a row marked '<- stuck' and a verdict) is not in the output")
    return {"stuck_rank": int(m[1]), "stuck_for_s": float(m[2]), "verdict": verdict[1],
            "exit_code": code, "wall_s": wall_s}


def _check(run: Path, output: str, code: int, wall_s: float) -> dict:
    return json.loads(output.strip().splitlines()[-1])


def _transparency(run: Path, output: str, code: int, wall_s: float) -> dict:
    """Each case of the trainer's layouts (`pytest -rA` names every one): those in fp32 against one
    device, and those in bf16 (their test names say so) against fp32, each group with the
    tolerance its tests assert (FP32_ABS and BF16_ABS of the test file)."""
    source = Path("tests/train/test_trainer.py").read_text(encoding="utf-8")
    tolerance = {k: float(re.search(rf"^{k.upper()}_ABS = (\S+)$", source, re.M)[1]) for k in ("fp32", "bf16")}
    outcomes = re.findall(r"^(PASSED|FAILED|ERROR) tests/train/test_trainer\.py::(\w+)(?:\[([^\]]+)\])?", output, re.M)
    if not outcomes:
        raise RunError("pytest named no case of tests/train/test_trainer.py: the run did not get that far")
    groups: dict[str, dict] = {k: {"tolerance": tolerance[k], "passed": 0, "failed": 0, "cases": []}
                               for k in ("fp32", "bf16")}
    for outcome, test, case in outcomes:
        group = groups["bf16" if "bf16" in test else "fp32"]
        group["passed" if outcome == "PASSED" else "failed"] += 1
        group["cases"].append(f"{test.removeprefix('test_')}[{case}]" if case else test.removeprefix("test_"))
    return {**groups, "wall_s": wall_s}


ROOT = "needs root for network namespaces: run `sudo python -m pytest -m full tests/e2e/test_two_hosts.py -s`"
_T = " ".join(TINY)
_PYTEST = "python -m pytest tests/train/test_trainer.py -p no:cacheprovider -m '' -rA"  # every tier's cases
JOBS: dict[str, Job] = {
    "main": Job("brigade train", "train/main.json", f"brigade train {_T} --max-steps 4", _main),
    "transparency": Job(_PYTEST, "check/transparency.json", f"{_PYTEST} -k accumulation_matches",
                        _transparency, takes_out=False),
    "check": Job("brigade check --model gpt --stages 4 --microbatches 8 --json", "check/check.json",
                 "brigade check --model toy --stages 2 --microbatches 2 --json", _check, takes_out=False),
    "check-local": Job("brigade check --model gpt --stages 4 --microbatches 8 --runtime local --json",
                       "check/check-local.json",
                       "brigade check --model toy --stages 2 --microbatches 2 --runtime local --json", _check,
                       takes_out=False),
    "overhead": Job("python -m brigade.results.overhead", "overhead/overhead.json",
                    "python -m brigade.results.overhead --tiny --steps 3 --rounds 1 --warmup 1"),
    "speed": Job("python -m brigade.results.speed --schedule zb --microbatches 2", "speed/speed.json",
                 "python -m brigade.results.speed --schedule zb --microbatches 2 --repeats 1"),
    "speed-1f1b": Job("python -m brigade.results.speed --schedule 1f1b --microbatches 2",
                      "speed-1f1b/speed.json",
                      "python -m brigade.results.speed --schedule 1f1b --microbatches 2 --repeats 1"),
    "bench-gpt": Job("brigade bench --model gpt --quick", "bench-gpt/bench.json", f"brigade bench {TOY}"),
    "bench": Job("brigade bench --splits 4,2", "bench/bench.json", f"brigade bench {TOY}"),
    "bench-malloc": Job("brigade bench --splits 4 --schedules 1f1b --malloc-defaults",
                        "bench-malloc/bench.json", f"brigade bench {TOY} --malloc-defaults"),
    "bench-mlp": Job("brigade bench --model mlp --batch-size 256 --splits 128", "bench-mlp/bench.json",
                     f"brigade bench {TOY}"),
    # pp 4: four processes on this machine's two cores, every schedule slowed alike
    "bench-gpt-pp4": Job("brigade bench --model gpt --quick --ranks 4", "bench-gpt-pp4/bench.json",
                         f"brigade bench {TOY_PP4}"),
    "bench-mlp-pp4": Job("brigade bench --model mlp --batch-size 256 --splits 32 --ranks 4",
                         "bench-mlp-pp4/bench.json", f"brigade bench {TOY_PP4}"),
    "bench-resnet-pp4": Job("brigade bench --splits 4,2 --ranks 4", "bench-resnet-pp4/bench.json",
                            f"brigade bench {TOY_PP4}"),
    "bound": Job("python -m brigade.results.cut_bound", "bound/bound.json",
                 "python -m brigade.results.cut_bound --tiny"),
    "snapshot": Job("brigade train --max-steps 300", "train/snapshot.json",
                    f"brigade train {_T} --max-steps 8 --snapshot-every 2", _snapshot),
    "restart": Job("brigade train --max-steps 300 --inject-fault kill:rank=1:step=150 --max-restarts 1",
                   "faults/restart.json", f"brigade train {_T} --max-steps 6 --snapshot-every 2 "
                   "--inject-fault kill:rank=1:step=4 --max-restarts 1", _restart),
    "hang": Job("brigade train --nproc 4 --pp 2 --hang-timeout 10 --inject-fault stall:rank=1:step=5",
                "faults/hang.json", f"brigade train {_T} --max-steps 6 --nproc 4 --pp 2 --hang-timeout 10 "
                "--inject-fault stall:rank=1:step=3", _hang, expect_exit=1),
    "tune-gpt": Job("brigade tune --model gpt --quick --verify", "tune-gpt/tune.json",
                    "brigade tune --model toy --batch-size 8 --splits 8,4 --repeats 1 --verify"),
    "footprint": Job("python -m brigade.results.footprint", "footprint/footprint.json",
                     "python -m brigade.results.footprint --tiny --steps 3 --repeats 1"),
    "plan": Job("python -m brigade.results.plan_accuracy", "plan/accuracy.json",
                "python -m brigade.results.plan_accuracy --tiny --steps 4"),
    "big-plans": Job("python -m brigade.results.big_plans", "plan/big_plans.json",
                     "python -m brigade.results.big_plans --tiny"),
    "published": Job("python -m brigade.results.published", "plan/published_vs_planned.json",
                     "python -m brigade.results.published --tiny"),
    "moe-plan": Job("python -m brigade.results.moe_plan", "plan/moe_plan.json",
                    "python -m brigade.results.moe_plan --tiny"),
    "long-context": Job("python -m brigade.results.long_context", "plan/long_context.json",
                        "python -m brigade.results.long_context --tiny"),
    "experts": Job("python -m brigade.results.experts", "experts/experts.json",
                   "python -m brigade.results.experts --tiny --steps 4 --rounds 1"),
    "context": Job("python -m brigade.results.context", "context/context.json",
                   "python -m brigade.results.context --tiny"),
    "levers": Job("python -m brigade.results.levers", "levers/levers.json",
                  "python -m brigade.results.levers --tiny --rounds 1"),
    "data": Job("python -m brigade.results.data_scale", "data/data_scale.json",
                "python -m brigade.results.data_scale --tiny"),
    "snapshot-stall": Job("python -m brigade.results.snapshot_stall", "snapshots/snapshot_stall.json",
                          "python -m brigade.results.snapshot_stall --tiny"),
    "kill-campaign": Job("python -m brigade.results.kill_campaign", "faults/kill_campaign.json",
                         "python -m brigade.results.kill_campaign --tiny"),
    "head-loss": Job("python -m brigade.results.head_loss", "head-loss/head_loss.json",
                     "python -m brigade.results.head_loss --tiny"),
    "lora": Job("python -m brigade.results.lora", "lora/lora.json", "python -m brigade.results.lora --tiny"),
    "two-hosts": Job("", "two-hosts/two_hosts.json", needs_root=ROOT),
    "doctor-two-hosts": Job("", "two-hosts/doctor.json", needs_root=ROOT),
}


def run_job(name: str, job: Job, results: Path, quick: bool) -> Path:
    """Run one job; returns the JSON file it wrote.

    Raises:
        RunError: the command failed, or its output lacks the figures.
    """
    target = results / job.file
    with tempfile.TemporaryDirectory(prefix=f"brigade-results-{name}-") as tmp:
        out = Path(tmp) / "run" if job.extract else target.parent
        argv = job.argv(quick)
        if job.takes_out:
            argv += ["--out", str(out)]
        print(f"[{name}] {' '.join(argv[1:])}", flush=True)
        start = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wall = time.perf_counter() - start
        if done.returncode != job.expect_exit:
            tail = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
            raise RunError(f"[{name}] exit {done.returncode}, expected {job.expect_exit}: {tail}")
        if job.extract:
            figures = job.extract(out, done.stdout + done.stderr, done.returncode, wall)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")
    if not target.is_file():
        raise RunError(f"[{name}] finished but wrote no {target}")
    # what wrote it: the command as the page shows it, and the code that ran it
    stamped = {"command": job.quick if quick else job.command, **json.loads(target.read_text(encoding="utf-8")),
               "measured_at": provenance.commit()}
    target.write_text(json.dumps(stamped, indent=1) + "\n", encoding="utf-8")
    print(f"[{name}] wrote {target} in {wall:.0f} s", flush=True)
    return target


def select(only: str) -> list[str]:
    """Job names from `--only a,b` (all when empty).

    Raises:
        BrigadeError: an unknown name.
    """
    names = [n.strip() for n in only.split(",") if n.strip()] or list(JOBS)
    unknown = [n for n in names if n not in JOBS]
    if unknown:
        raise BrigadeError(f"--only {','.join(unknown)}: unknown; expected names from {', '.join(JOBS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m brigade.results", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results", help="the results folder (default: %(default)s)")
    parser.add_argument("--only", default="", help="comma-separated jobs: " + ", ".join(JOBS))
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to test this script")
    parser.add_argument("--table", action="store_true",
                        help="only print the results table (docs/results.md) from --out")
    parser.add_argument("--page", action="store_true",
                        help="only rewrite docs/results.md's table and paragraphs from --out")
    args = parser.parse_args(argv)
    from brigade.results import page
    from brigade.results.table import table

    try:
        names = select(args.only)
        results = Path(args.out)
        if args.quick and results.resolve() == Path("results").resolve():
            raise BrigadeError("--quick writes toy figures: give another --out than results/")
        for name in [] if args.table or args.page else names:
            job = JOBS[name]
            if job.needs_root and os.geteuid() != 0:
                print(f"[{name}] skipped, {job.needs_root}; {results / job.file} kept", flush=True)
            elif job.needs_root:
                print(f"[{name}] {job.needs_root}, then write {results / job.file}", flush=True)
            else:
                run_job(name, job, results, args.quick)
        ours = results.resolve() == (provenance.CHECKOUT / "results").resolve()
        if args.page and not ours:
            raise BrigadeError(f"--page writes docs/results.md from results/, not {results}: leave out --out")
        if args.page or (ours and not args.table):  # a run into results/ rewrites the page it measured for
            changed = page.rewrite(results)
            print(f"docs/results.md {'rewritten' if changed else 'already up to date'} from results/", flush=True)
        elif not args.quick:
            print(table(results))
    except (OSError, KeyError) as exc:  # from table(): a file or a figure is missing
        print(f"brigade results: error: the table needs {exc}: run the job that writes it", file=sys.stderr)
        return 1
    except BrigadeError as exc:
        print(f"brigade results: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0

