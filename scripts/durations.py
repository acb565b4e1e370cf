"""Where the suite's time goes: a JUnit report of one pytest run, summed by file and by test.

Run the tier with a report, then summarise it into a JSON under results/testing/ (issue 59:
find the time where it goes before removing it at the cause):

    python -m pytest --junitxml /tmp/default.xml
    python scripts/durations.py /tmp/default.xml --tier default --wall-s 1434 --out results/testing/durations-default.json

The JSON holds the test count, the summed test time (both xdist workers together, so it is
about twice the wall time on two cores), the wall time as pytest printed it (`--wall-s`, given
by hand: the report does not hold it), every file's total and count, and the slowest tests.
What else shared the machine during the run goes in `--note`, since it moves every figure.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="a JUnit XML report (pytest --junitxml)")
    parser.add_argument("--tier", required=True, help="which tier the run was: default, slow, ...")
    parser.add_argument("--wall-s", type=float, required=True, help="the run's wall time, as pytest printed it")
    parser.add_argument("--note", default="", help="what else ran on the machine meanwhile")
    parser.add_argument("--out", type=Path, required=True, help="where the JSON goes")
    args = parser.parse_args(argv)
    if not args.report.is_file():
        print(f"durations: {args.report} is not a file: give the report `pytest --junitxml PATH` wrote",
              file=sys.stderr)
        return 2
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parents[1]).stdout.strip()
    data = {"tier": args.tier, "commit": commit, "wall_s": args.wall_s, "note": args.note,
            **summarise(args.report)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"{args.out}: {data['tests']} tests, {data['summed_test_s'] / 60:.1f} test-minutes, "
          f"{args.wall_s / 60:.1f} minutes of wall time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
