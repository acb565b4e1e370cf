"""brigade.results.kill_campaign: the plan of trials, the table, and the committed campaign
(docs/results.md and docs/faults.md quote it). Its whole run, --tiny, is docs/faults.md's command
in tests/e2e/test_readme.py; the slow tier runs a short campaign (tests/e2e/test_kill_campaign.py)."""

import json
from pathlib import Path

from brigade.results import kill_campaign

ROOT = Path(__file__).resolve().parents[2]


def test_the_plan_takes_every_layout_both_schedules_and_every_kind_and_is_seeded():
    trials = kill_campaign.plan(list(kill_campaign.LAYOUTS), per_layout=10, seed=0)
    assert trials == kill_campaign.plan(list(kill_campaign.LAYOUTS), per_layout=10, seed=0)
    for layout, (_, zero_bubble) in kill_campaign.LAYOUTS.items():
        mine = [t for t in trials if t.layout == layout]
        assert len(mine) == 10 and {t.schedule for t in mine} == {zero_bubble, "1f1b"}
        assert {t.kind for t in mine} == set(kill_campaign.KINDS)
        assert all(0 <= t.rank < kill_campaign.nproc(layout) for t in mine)
        assert all(t.step % kill_campaign.EVERY == 0 for t in mine if t.kind == "snapshot")


def test_the_table_counts_per_layout():
    rows = [{"layout": "a", "schedule": "zb", "kind": "step", "killed": True, "bit_identical": True,
             "restarts": 1},
            {"layout": "a", "schedule": "1f1b", "kind": "outside", "killed": True, "bit_identical": False,
             "restarts": 1}]
    [row] = kill_campaign.table(rows)
    assert (row["trials"], row["killed"], row["bit_identical"], row["restarts"]) == (2, 2, 1, 2)
    assert row["by_kind"] == {"step": 1, "snapshot": 0, "outside": 1}


def test_the_committed_campaign_ends_every_run_bit_identical():
    result = json.loads((ROOT / "results" / "faults" / "kill_campaign.json").read_text())
    assert result["command"] == "python -m brigade.results.kill_campaign" and result["per_layout"] == 10
    assert [r["layout"] for r in result["table"]] == list(kill_campaign.LAYOUTS)
    for r in result["table"]:
        assert r["trials"] == r["killed"] == r["bit_identical"] == 10, r
        assert r["restarts"] >= 10
