"""brigade.results.context: the search for the longest sequence within the limit, and the committed
figures (docs/context-parallel.md and docs/results.md quote them). Its whole run, --tiny, is
docs/context-parallel.md's command in tests/e2e/test_readme.py."""

import json
from pathlib import Path

from brigade.results import context

ROOT = Path(__file__).resolve().parents[2]


def test_the_search_doubles_then_halves_the_gap_and_keeps_the_longest_that_fits(monkeypatch):
    """A peak of 10 bytes a position under a limit of 45 000: 1024 fits, 2048 and 4096 fit, 8192
    does not; halving the gap twice tries 6144 (no) and 5120 (no): the longest is 4096."""
    seen = []

    def run(cp, seq, steps=3):
        seen.append(seq)
        return {"cp": cp, "seq": seq, "peak": 10 * seq, "activations": seq, "step_s": 0.0}

    monkeypatch.setattr(context, "run", run)
    got = context.longest(2, 45_000, run(2, 1024))
    assert seen == [1024, 2048, 4096, 8192, 6144, 5120]
    assert got["longest"] == 4096 and [r["seq"] for r in got["tried"]] == sorted(seen)
    got = context.longest(4, 45_000, {"cp": 4, "seq": 8192, "peak": 81_920}, halvings=0)
    assert got["longest"] == 0  # even the first does not fit: none


def test_the_committed_figures_halve_the_activations_and_lengthen_the_sequence():
    result = json.loads((ROOT / "results" / "context" / "context.json").read_text())
    assert result["command"] == "python -m brigade.results.context" and result["seq"] == 1024
    ratios = {r["cp"]: r["ratio"] for r in result["at_1024"]}
    assert ratios[1] == 1.0 and ratios[2] <= 0.55 and ratios[4] < ratios[2]  # the target
    longest = [r["longest"] for r in result["longest"]]
    assert [r["cp"] for r in result["longest"]] == [1, 2, 4] and longest[0] < longest[1] < longest[2]
    assert longest[2] >= 2 * longest[0]
