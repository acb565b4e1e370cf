"""brigade.results.snapshot_stall: the comparison, and the committed figures (docs/results.md and
docs/faults.md quote them). Its whole run, --tiny, is docs/faults.md's command in
tests/e2e/test_readme.py."""

import json
from pathlib import Path

from brigade.results import snapshot_stall

ROOT = Path(__file__).resolve().parents[2]


def _run(mode: str, stalls: list[float], run_s: float) -> dict:
    return {"layout": "dp 2", "mode": mode, "state_bytes": 600e6, "stall_s": stalls,
            "written_s": [2.0] if mode == "async" else [], "run_s": run_s}


def test_the_comparison_takes_the_mean_stall_and_the_slowdown_against_no_snapshots():
    [row] = snapshot_stall.compare([_run("none", [], 10.0), _run("sync", [2.0, 4.0], 16.0),
                                    _run("async", [0.2, 0.4], 11.0)])
    assert row["stall_sync_s"] == 3.0 and abs(row["stall_async_s"] - 0.3) < 1e-12
    assert abs(row["ratio"] - 0.1) < 1e-12 and row["state_mb"] == 600
    assert abs(row["slowdown_sync"] - 0.6) < 1e-12 and abs(row["slowdown_async"] - 0.1) < 1e-12


def test_the_committed_stall_in_the_background_is_at_most_a_fifth_of_the_stall_at_once():
    result = json.loads((ROOT / "results" / "snapshots" / "snapshot_stall.json").read_text())
    assert result["command"] == "python -m brigade.results.snapshot_stall" and result["every"] == 10
    assert [r["layout"] for r in result["table"]] == list(snapshot_stall.LAYOUTS)
    for r in result["table"]:
        assert r["state_mb"] >= 500, r  # the size (dp 2: DCP writes the replica once)
        assert r["ratio"] <= snapshot_stall.GOAL, r  # the goal
