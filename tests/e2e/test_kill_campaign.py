"""The full tier's short kill campaign: on every layout of `brigade.results.kill_campaign` (shard 2
× pp 2, tp 2 × pp 2, HSDP 2 × 2 × pp 2, ep 2 × pp 2, cp 2 × pp 2), one kill under its zero-bubble
schedule and one under 1f1b, snapshots in the background; each run must end bit for bit where
its uninterrupted twin ends. The kinds (a kill at a step, during a background snapshot's write,
from outside at a random moment) take turns across the layouts, so each kind meets several
layouts; the results script runs ten a layout (`results/faults/kill_campaign.json`).
"""

import pytest

from brigade.results import kill_campaign

pytestmark = [pytest.mark.full, pytest.mark.timeout(900)]
TRIALS = kill_campaign.plan(list(kill_campaign.LAYOUTS), per_layout=2, seed=7)


@pytest.mark.parametrize("layout", list(kill_campaign.LAYOUTS))
def test_a_short_kill_campaign_ends_bit_identical(tmp_path, layout):
    mine = [t for t in TRIALS if t.layout == layout]
    assert {t.schedule for t in mine} == {kill_campaign.LAYOUTS[layout][1], "1f1b"}
    for i, t in enumerate(mine):
        twin = kill_campaign.twin(tmp_path, t.layout, t.schedule)
        got = kill_campaign.run_trial(tmp_path, i, t)
        assert got["killed"], f"{t}: the run ended before the kill from outside"
        assert got["restarts"] == 1, f"{t}: {got['restarts']} restarts"
        assert got["params_sha256"] == twin["params_sha256"], f"{t}: the parameters differ"
        assert got["losses"] == twin["losses"], f"{t}: the losses differ"


def test_the_kinds_take_turns_across_layouts():
    assert {t.kind for t in TRIALS} == set(kill_campaign.KINDS)
    for t in TRIALS:
        if t.kind == "snapshot":
            assert t.step % kill_campaign.EVERY == 0 and t.step < kill_campaign.STEPS
