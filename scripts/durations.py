"""Where the suite's time goes, and how many tests each tier holds: results/testing/ and the block
of docs/testing.md that shows them.

CI (`.ci/run`) runs the suite in two steps: the README's `python -m pytest` (the default tier),
then `python -m pytest -m "full or slow"` (the full and the slow tiers in one run). Run a step with
a JUnit report, then summarise it into a JSON under results/testing/
(issue 59: find the time where it goes before removing it at the cause):

    python -m pytest --junitxml /tmp/default.xml
    python scripts/durations.py /tmp/default.xml --step default --wall-s 438

The JSON holds the test count, the summed test time (both xdist workers together, so it is
about twice the wall time on two cores), the wall time as pytest printed it (`--wall-s`, given
by hand: the report does not hold it), every file's total and count, and the slowest tests.
What else shared the machine during the run goes in `--note`, since it moves every figure, and
`--setup-s` the set-up before it where the run was CI's from a fresh clone (`.ci/run` prints
each step's time, and writes the reports with BRIGADE_CI_REPORTS=DIR):

    BRIGADE_CI_REPORTS=/tmp/ci bash .ci/run        # in a fresh clone and virtual environment
    python scripts/durations.py /tmp/ci/default.xml --step default --wall-s D --setup-s S
    python scripts/durations.py /tmp/ci/full-slow.xml --step full-slow --wall-s F

    python scripts/durations.py --tiers

collects the whole suite (`-m ""`, ~12 s) and writes each tier's count to results/testing/tiers.json.
Both forms then rewrite the block of docs/testing.md between its `<!-- tiers -->` markers from
the files (tests/test_docs.py fails when the page and the files disagree); `--check` only
compares.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from brigade.results import provenance

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "testing"
PAGE = ROOT / "docs" / "testing.md"
BEGIN, END = "<!-- tiers: written by `python scripts/durations.py` from results/testing/; do not edit -->", "<!-- /tiers -->"
BEFORE = "durations-default-deb38ba.json"  # the default tier before tests/tiers.py split it (issue 59)
RUN_BY = {"default": "`python -m pytest` (the README's; CI's first step)",
          "full": "`python -m pytest -m full` (CI's second step, with the slow tier)",
          "slow": "`python -m pytest -m slow` (CI's second step, with the full tier)",
          "cuda": "`python -m pytest -m cuda` (scripts/gpu-check.sh, where a GPU is)"}
# CI's steps after its set-up (.ci/run): the command each runs and its tiers
STEPS = {"default": ("`python -m pytest`", ("default",)),
         "full-slow": ('`python -m pytest -m "full or slow"`', ("full", "slow"))}


def summarise(report: Path, slowest: int = 30) -> dict:
    """Per-file totals and the slowest tests of one JUnit report."""
    cases = list(ET.parse(report).iter("testcase"))
    files: dict[str, list[float]] = collections.defaultdict(list)
    for case in cases:
        files[case.get("classname", "")].append(float(case.get("time", 0)))
    ranked = sorted(cases, key=lambda c: -float(c.get("time", 0)))
    return {
        "tests": len(cases),
        "skipped": sum(1 for c in cases if c.find("skipped") is not None),
        "summed_test_s": round(sum(sum(v) for v in files.values()), 1),
        "files": [{"file": name.replace(".", "/") + ".py", "tests": len(v), "seconds": round(sum(v), 1)}
                  for name, v in sorted(files.items(), key=lambda kv: -sum(kv[1]))],
        "slowest": [{"test": f"{c.get('classname', '').replace('.', '/')}.py::{c.get('name')}",
                     "seconds": round(float(c.get("time", 0)), 1)} for c in ranked[:slowest]],
    }


def collect() -> dict[str, str]:
    """{node id: tier} for every case of the suite: collected in a process of its own (`-m ""`),
    each case given its tier by tests/tiers.py's `--tiers-report`.

    Raises:
        SystemExit: the collection failed (its output's tail says why).
    """
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "tiers.json"
        argv = [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", "-m", "", "--collect-only",
                "-q", f"--tiers-report={report}", "tests"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=170)
        if done.returncode != 0:
            raise SystemExit(f"durations: collecting the suite failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        return json.loads(report.read_text())


def collect_tiers() -> dict[str, int]:
    """How many cases each tier holds."""
    return dict(sorted(collections.Counter(collect().values()).items()))


def _load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.is_file() else None


def _clock(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def _slowest(data: dict, n: int = 10) -> str:
    return "\n".join(f"{i}. `{t['test']}`: {t['seconds']:.1f} s" for i, t in enumerate(data["slowest"][:n], 1))


def block() -> str:
    """The block of docs/testing.md: the tests per tier, CI's steps as last measured, CI's whole run
    where its steps were measured together from a fresh clone, and the ten slowest tests of each
    step (the default's also before the split); every figure from a file of results/testing/."""
    counts = json.loads((RESULTS / "tiers.json").read_text())
    text = [f"Tests per tier at {counts['commit']} (`results/testing/tiers.json`):", "",
            "| tier | run by | tests |", "|---|---|---|",
            *(f"| {tier} | {run_by} | {counts['tests'].get(tier, 0)} |" for tier, run_by in RUN_BY.items()),
            "", _steps(counts, runs := {step: _load(f"durations-{step}.json") for step in STEPS}), ""]
    default = runs["default"]
    if all(runs.values()) and "setup_s" in default and len({r["commit"] for r in runs.values()}) == 1:
        ci = default["setup_s"] + sum(r["wall_s"] for r in runs.values())
        text += [f"CI (`.ci/run`: set-up, then its two steps) from a fresh clone and "
                 f"virtual environment at {default['commit']}: {_clock(ci)} in all, "
                 f"{_clock(default['setup_s'])} of it set-up.", ""]
    before = _load(BEFORE)
    if before and default:
        text += [f"The default tier's ten slowest tests before the split, {_run(before)}:", "",
                 _slowest(before), ""]
    for step, data in runs.items():
        if data:
            text += [f"The {step} step's ten slowest, {_run(data)}:", "", _slowest(data), ""]
    return "\n".join([BEGIN, *text, END])


def _run(data: dict) -> str:
    """A run as the block names it: its commit, tests, wall time and summed test time."""
    return (f"at {data['commit']} ({data['tests']} tests, {_clock(data['wall_s'])}, "
            f"{data['summed_test_s'] / 60:.1f} test-minutes)")


def _steps(counts: dict, runs: dict[str, dict | None]) -> str:
    """The table of CI's steps: what each runs, its tests now, its last measured
    wall time (`runs`: each one's durations file, None where there is none)."""
    rows = ["CI's two steps, each as last measured (`results/testing/durations-STEP.json`; "
            "a run's count includes the GPU tier's where it skips there):", "",
            "| step | runs | tests now | wall time on 2 CPU cores | measured at |", "|---|---|---|---|---|"]
    for step, (command, tiers) in STEPS.items():
        data = runs[step]
        wall = f"{_clock(data['wall_s'])} ({data['tests']} tests)" if data else "not recorded"
        now = sum(counts["tests"].get(tier, 0) for tier in tiers)
        rows.append(f"| {step} | {command} | {now} | {wall} | {data['commit'] if data else ''} |")
    return "\n".join(rows)


def refresh_page(check: bool = False) -> bool:
    """Rewrite (or with check, compare) the block of docs/testing.md; whether it was already so."""
    page = PAGE.read_text(encoding="utf-8")
    start, end = page.index(BEGIN), page.index(END) + len(END)
    new = page[:start] + block() + page[end:]
    if not check and new != page:
        PAGE.write_text(new, encoding="utf-8")
    return new == page


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, nargs="?", help="a JUnit XML report (pytest --junitxml)")
    parser.add_argument("--step", choices=list(STEPS),
                        help="which run it was: CI's default step or its full-slow step")
    parser.add_argument("--wall-s", type=float, help="the run's wall time, as pytest printed it")
    parser.add_argument("--setup-s", type=float, help="where the run was CI's: the set-up before it")
    parser.add_argument("--note", default="", help="what else ran on the machine meanwhile")
    parser.add_argument("--commit", help="the commit the run tested, where it is not the checkout's now")
    parser.add_argument("--out", type=Path, help="where the JSON goes (results/testing/durations-STEP.json)")
    parser.add_argument("--tiers", action="store_true", help="count the tests of each tier into tiers.json")
    parser.add_argument("--check", action="store_true", help="only say whether docs/testing.md is up to date")
    return parser


def _summary(args: argparse.Namespace) -> int:
    if not args.report.is_file():
        print(f"durations: {args.report} is not a file: give the report `pytest --junitxml PATH` wrote",
              file=sys.stderr)
        return 2
    if not args.step or args.wall_s is None:
        print("durations: a report needs --step and --wall-s (the wall time pytest printed at its end)",
              file=sys.stderr)
        return 2
    out = args.out or RESULTS / f"durations-{args.step}.json"
    data = {"step": args.step, "commit": args.commit or provenance.commit(ROOT), "wall_s": args.wall_s,
            "note": args.note,
            **({"setup_s": args.setup_s} if args.setup_s is not None else {}), **summarise(args.report)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"{out}: {data['tests']} tests, {data['summed_test_s'] / 60:.1f} test-minutes, "
          f"{args.wall_s / 60:.1f} minutes of wall time")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.check:
        fresh = refresh_page(check=True)
        print("docs/testing.md is up to date" if fresh else
              "docs/testing.md differs from results/testing/: run `python scripts/durations.py --tiers`")
        return 0 if fresh else 1
    if args.report is not None:
        status = _summary(args)
        if status or (args.out and args.out.parent.resolve() != RESULTS):
            return status
    elif args.tiers:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "tiers.json").write_text(json.dumps({"commit": provenance.commit(ROOT), "tests": collect_tiers()},
                                                       indent=1) + "\n", encoding="utf-8")
    else:
        print("durations: give a JUnit report (with --step and --wall-s), or --tiers, or --check", file=sys.stderr)
        return 2
    refresh_page()
    return 0


if __name__ == "__main__":
    sys.exit(main())
