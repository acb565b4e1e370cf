"""The layout space covers every registered schedule and only valid layouts; the tuner's sweep
leaves out, and says why, what its model cannot take."""

import pytest

from brigade.errors import BrigadeError
from brigade.pipeline.plans.schedule import SCHEDULES
from brigade.planner.space import Layout, check, enumerate_layouts, search_space


def test_every_registered_schedule_is_in_the_space():
    rows = enumerate_layouts(4, 8, 16, ["none", "full"])
    assert {r.schedule for r in rows if r.pp > 1} == set(SCHEDULES)
    for r in rows:
        check(r, 4, 8, 16)  # each one valid
    assert {(r.replicate, r.shard) for r in rows if r.pp == 1} == {(4, 1), (2, 2), (1, 4)}
    fixed = {n for n, s in SCHEDULES.items() if s.virtual}
    assert all(r.virtual == SCHEDULES[r.schedule].virtual for r in rows if r.schedule in fixed and r.pp > 1)


def test_stages_never_exceed_the_blocks_and_micro_batches_divide():
    rows = enumerate_layouts(4, 3, 8, ["none"])
    assert rows and all(r.pp * r.virtual <= 3 for r in rows)
    assert all((8 // r.dp) % r.microbatches == 0 for r in rows)


@pytest.mark.parametrize(
    "layout, words",
    [
        (Layout(1, 1, 3, "1f1b", 1, 1, "none"), "= 3 ranks, but the cluster has 4"),
        (Layout(1, 1, 4, "zbv", 2, 1, "none"), "8 stages, but the model has 6 blocks"),
        (Layout(4, 1, 1, "1f1b", 1, 3, "none"), "batch 16 does not divide into dp 4 replicas of 3"),
    ],
)
def test_a_layout_that_does_not_divide_is_one_line(layout, words):
    with pytest.raises(BrigadeError, match=words):
        check(layout, 4, 6, 16)


def test_the_space_leaves_out_two_stages_per_rank_without_enough_blocks_and_says_why():
    rows, left_out = search_space(["1f1b", "interleaved", "zbv"], [2, 4], ranks=2, n_blocks=3)
    assert {(r["schedule"], r["virtual"], r["microbatches"]) for r in rows} == {
        (s, 1, m) for s in ("1f1b", "interleaved") for m in (2, 4)}
    assert [(r["schedule"], r["virtual"]) for r in left_out] == [("interleaved", 2), ("zbv", 2)]
    assert all("3 blocks: 4 stages" in r["reason"] for r in left_out)
    rows, left_out = search_space(["1f1b", "interleaved", "zbv"], [2], ranks=2, n_blocks=4)
    assert [(r["schedule"], r["virtual"]) for r in rows] == [("1f1b", 1), ("interleaved", 1),
                                                             ("interleaved", 2), ("zbv", 2)]
    assert left_out == [] and all(r["dp"] == 1 and r["pp"] == 2 for r in rows)
