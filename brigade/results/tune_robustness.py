"""How far the tuner's choice lands from the sweep's best, over several `brigade tune` runs in a row.

    python -m brigade.results.tune_robustness --runs 5                 # results/tune-robustness.json
    python -m brigade.results.tune_robustness --runs 2 --tune-args "--model toy --batch-size 8 --splits 4,2"

Each run is `brigade tune ARGS --verify --json` in a fresh process; the machine's load average
is read before and after it (on a shared machine the figures mean little without it). Per run
the file keeps the choice, its time in the search, its time again in the sweep, the sweep's
best, `within` (the median round's ratio of the two, minus 1) and, for comparison, what the
sweep's medians alone say: the lowest median and the choice's median over it (the rule the
tuner used before it ranked within rounds, see bench.choose). The summary is the worst run.
The file is rewritten after every run, so an interrupted series keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from brigade.fsutil import write_atomic

DEFAULT_TUNE = "--model gpt --quick"


def row_of(run: int, written: dict, load_before: list[float], load_after: list[float], wall_s: float) -> dict:
    """One run's figures from the tune.json it wrote (with --verify's sweep).

    Args:
        run: its number (1 first). written: the tune.json. load_*: `os.getloadavg()` around it.
    """
    by_median = min(written["sweep"], key=lambda r: r["mean_s"])
    return {"run": run, "load_before": load_before, "load_after": load_after, "wall_s": wall_s,
            "chosen": written["chosen_label"], "search_s": written["chosen_mean_s"],
            "resweep_s": written["chosen_sweep_mean_s"], "sweep_best": written["sweep_best_label"],
            "sweep_best_s": written["sweep_best_mean_s"], "within": written["within"],
            "within_ci": written["within_ci"],
            "search_over_sweep_best": written["chosen_mean_s"] / written["sweep_best_mean_s"],
            "lowest_median": _label(by_median), "within_of_medians":
                written["chosen_sweep_mean_s"] / by_median["mean_s"] - 1}


def _label(row: dict) -> str:
    from brigade.planner.sweep import label

    return label(row)


def summary(rows: list[dict]) -> dict:
    """The worst run: the largest `within` (and its ratio), and the highest load seen."""
    worst = max(rows, key=lambda r: r["within"])
    return {"runs": len(rows), "worst_run": worst["run"], "worst_within": worst["within"],
            "worst_ratio": 1 + worst["within"], "worst_within_of_medians":
                max(r["within_of_medians"] for r in rows),
            "max_load_1min": max(max(r["load_before"][0], r["load_after"][0]) for r in rows)}


def tune_once(run: int, tune_args: list[str], work: Path) -> dict:
    """Run `brigade tune` once into work/tuneRUN; its row.

    Raises:
        SystemExit: the run failed (its stderr is printed).
    """
    out = work / f"tune{run}"
    before = list(os.getloadavg())
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "brigade", "tune", *tune_args, "--verify", "--json", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"run {run}: {shlex.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    wall = time.perf_counter() - start
    written = json.loads((out / "tune.json").read_text(encoding="utf-8"))
    return row_of(run, written, before, list(os.getloadavg()), wall)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m brigade.results.tune_robustness",
                                description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5, help="tune runs in a row (default: %(default)s)")
    p.add_argument("--tune-args", default=DEFAULT_TUNE,
                   help="brigade tune's arguments, --verify and --json added (default: %(default)s)")
    p.add_argument("--out", default="results/tune-robustness.json", help="the file (default: %(default)s)")
    p.add_argument("--work", default="/tmp/tune-runs",
                   help="each run's folder goes here (default: %(default)s)")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs {args.runs}: give 1 or more")
    out, work = Path(args.out), Path(args.work)
    out.parent.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "-m", "brigade.results.tune_robustness", "--runs", str(args.runs),
                          "--tune-args", args.tune_args])
    rows = []
    for run in range(1, args.runs + 1):
        rows.append(tune_once(run, shlex.split(args.tune_args), work))
        r = rows[-1]
        print(f"run {run}: load {r['load_before'][0]:.2f}->{r['load_after'][0]:.2f}, chose {r['chosen']} "
              f"(search {r['search_s']:.3f} s, sweep {r['resweep_s']:.3f} s), best {r['sweep_best']} "
              f"{r['sweep_best_s']:.3f} s: within {100 * r['within']:+.1f} %", flush=True)
        data = {"command": command, "cpus": os.cpu_count(), "rows": rows, "summary": summary(rows)}
        write_atomic(out, json.dumps(data, indent=1))
    s = data["summary"]
    print(f"worst of {s['runs']}: run {s['worst_run']}, within {100 * s['worst_within']:+.1f} % "
          f"(×{s['worst_ratio']:.3f}); highest 1-minute load {s['max_load_1min']:.2f}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
