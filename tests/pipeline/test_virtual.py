"""Several stages per rank: interleaved 1F1B, looped BFS and ZB-V as pure plans.

Each plan is checked like the one-stage schedules (validate, simulate, NCCL posting) over a
grid of ranks × stages per rank × micro-batches, and each bubble against its paper.
"""

import itertools
import re

import pytest

from brigade.pipeline import nccl, ordering
from brigade.pipeline.plan import render, simulate, validate
from brigade.pipeline.schedule import (
    SCHEDULES,
    PlanError,
    build,
    one_f_one_b,
    place,
    stage_ranks,
)
from brigade.pipeline.virtual import groups, interleaved, looped_bfs, zbv

RANKS, MICROBATCHES, VIRTUALS = (1, 2, 3, 4), (1, 2, 3, 4, 5, 8), (1, 2, 3)
LOOPED = ("interleaved", "looped-bfs")


def grid(name):
    """(p, V, m) for every V the schedule runs."""
    fixed = SCHEDULES[name].virtual
    return list(itertools.product(RANKS, (fixed,) if fixed else VIRTUALS, MICROBATCHES))


ALL = [(name, *case) for name in (*LOOPED, "zbv") for case in grid(name)]


def plan_str(plan):
    return {r: " ".join(map(str, acts)) for r, acts in plan.items()}


def rank_peak(plan):
    """Per rank, the most stage-activations held at once (F done, its B or W not yet)."""
    peaks = {}
    for r, acts in plan.items():
        held = peak = 0
        for a in acts:
            held += a.op == "F"
            held -= a.op in ("B", "W")
            peak = max(peak, held)
        peaks[r] = peak
    return peaks


def test_interleaved_two_ranks_two_stages_each_four_microbatches():
    assert plan_str(interleaved(2, 4, 2)) == {
        0: "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        1: "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    }


def test_looped_bfs_two_ranks_two_stages_each_four_microbatches():
    assert plan_str(looped_bfs(2, 4, 2)) == {
        0: "0F0 0F1 0F2 0F3 2F0 2F1 2F2 2F3 2B3 2B2 2B1 2B0 0B3 0B2 0B1 0B0",
        1: "1F0 1F1 1F2 1F3 3F0 3F1 3F2 3F3 3B3 3B2 3B1 3B0 1B3 1B2 1B1 1B0",
    }


def test_zbv_two_ranks_four_microbatches():
    assert plan_str(zbv(2, 4)) == {
        0: "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 "
           "0I1 0W1 3F3 3I3 3W3 0I2 0W2 0I3 0W3",
        1: "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 "
           "2F3 2I2 2W2 1I2 2I3 1I3 1W2 2W3 1W3",
    }


def test_interleaved_with_one_stage_per_rank_is_1f1b():
    for p, m in itertools.product(RANKS, MICROBATCHES):
        assert interleaved(p, m, 1) == one_f_one_b(p, m)


def test_interleaved_memory_is_warmup_plus_one():
    """Rank r holds 2(p-1-r) + (V-1)·g + 1 stage activations at most (g = p when p divides m:
    Megatron-LM's p(1+1/V) micro-batches of a rank on rank 0), never more than 2p-1 of a rank."""
    for p, v, m in grid("interleaved"):
        g = len(groups(p, m)[0])
        peaks = rank_peak(interleaved(p, m, v))
        for r, peak in peaks.items():
            want = p - r if v == 1 else 2 * (p - 1 - r) + (v - 1) * g + 1
            assert peak == min(want, v * m), (p, v, m, r)
            assert peak <= v * (2 * p - 1)
    assert rank_peak(interleaved(4, 8, 2))[0] == 11  # Megatron: 2(p-1) + (V-1)p + 1


def test_groups_spread_the_remainder_and_stay_at_least_p():
    assert [list(g) for g in groups(4, 9)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    assert [list(g) for g in groups(4, 3)] == [[0, 1, 2]]
    for p, m in itertools.product(RANKS, range(1, 20)):
        sizes = [len(g) for g in groups(p, m)]
        assert sum(sizes) == m and (min(sizes) >= p or len(sizes) == 1)


@pytest.mark.parametrize("name,p,v,m", ALL)
def test_plans_are_valid_and_placed(name, p, v, m):
    plan = build(name, p, m, v)
    validate(plan)
    want = place(SCHEDULES[name].placement, p, v)
    assert stage_ranks(plan) == dict(enumerate(want))


@pytest.mark.parametrize("mode", ordering.MODES)
@pytest.mark.parametrize("name,p,v,m", ALL)
def test_plans_run_under_nccl_grouped_posting(name, p, v, m, mode):
    nccl.check(validate(build(name, p, m, v)), "grouped", mode)


@pytest.mark.parametrize("name", LOOPED)
def test_bubble_is_megatrons_when_m_is_at_least_p(name):
    """Narayanan et al. 2021 (Megatron-LM, section 2.2.2): with V stages per rank the bubble
    is (p-1)/(V·m + p-1) of the step; in stage units (F = B = 1 per stage) the makespan is
    2(V·m + p-1). Breadth-first looping (Lamy-Poirier 2022) has the same bubble. Holds here for
    every m ≥ p, not only multiples of p (the groups spread m mod p)."""
    for p, v, m in grid(name):
        if m >= p:
            sim = simulate(build(name, p, m, v), 1.0, 1.0)
            assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1)), (p, v, m)
            assert sim.makespan == 2 * (v * m + p - 1)


@pytest.mark.parametrize("name", LOOPED)
def test_fewer_microbatches_than_ranks_still_beats_1f1b(name):
    """m < p: the first micro-batch must cross all p·V stages before chunk 1 can start on
    rank 0, so the makespan is 2(V·p + m - 1); still below 1F1B's bubble (p-1)/(m+p-1) for
    m ≥ 2 (equal at m = 1, where no schedule can overlap anything)."""
    for p, v, m in grid(name):
        if m < p:
            sim = simulate(build(name, p, m, v), 1.0, 1.0)
            assert sim.makespan == 2 * (v * p + m - 1), (p, v, m)
            one_f_one_b_bubble = (p - 1) / (m + p - 1)
            if m >= 2 and v >= 2:
                assert sim.bubble_fraction < one_f_one_b_bubble
            else:
                assert sim.bubble_fraction == pytest.approx(one_f_one_b_bubble)


@pytest.mark.parametrize("p", RANKS)
def test_zbv_bubble_and_memory_match_the_zero_bubble_paper(p):
    """Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6 (ZB-V): with
    T_F = T_B = T_W, ZB-V has (near) zero bubble and a peak activation memory of p·M_B, the
    same as 1F1B, balanced over the workers. Tested per stage (half a rank's layers) with
    F = I = W = 1 and m ≥ 2p: the only idle time left is the ramp of the first forward down
    the V, p-1 slots per rank (bubble (p-1)/(6m+p-1), vs 1F1B's (p-1)/(m+p-1)), and every
    rank holds at most 2p stage activations at once (= 1F1B's p micro-batches of a rank)."""
    for m in (2 * p, 2 * p + 1, 3 * p, 8):
        if m < 2 * p:
            continue
        plan = zbv(p, m)
        sim = simulate(plan, 1.0, 2.0, weight=1.0)
        assert all(idle == p - 1 for idle in sim.idle.values()), (p, m, sim.idle)
        assert sim.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1))
        assert rank_peak(plan) == {r: 2 * p for r in range(p)}
        assert sim.peak_held == {s: 2 * p - s for s in range(2 * p)}


def test_zbv_beats_1f1b_and_zb_at_1f1b_memory():
    for p, m in itertools.product((2, 3, 4), (4, 5, 8)):
        bubble = simulate(zbv(p, m), 1.0, 2.0, weight=1.0).bubble_fraction
        assert bubble < simulate(build("zb", p, m), 1.0, 2.0, weight=1.0).bubble_fraction
        assert bubble < (p - 1) / (m + p - 1)
        assert max(rank_peak(zbv(p, m)).values()) <= 2 * p


def test_render_shows_each_cells_stage():
    lines = render(build("interleaved", 2, 4, 2)).splitlines()
    assert lines[1].split("|")[1].split()[:4] == ["0F0", "0F1", "2F0", "2F1"]
    assert lines[2].split("|")[1].split()[:4] == [".", "1F0", "1F1", "3F0"]
    assert "3I0" in render(zbv(2, 4))


@pytest.mark.parametrize("name,virtual,message", [
    ("zbv", 3, "--virtual 3: schedule zbv runs exactly 2 stage(s) per rank"),
    ("1f1b", 2, "--virtual 2: schedule 1f1b runs exactly 1 stage(s) per rank"),
    ("interleaved", -1, "--virtual -1: schedule interleaved runs any V of 1 or more"),
])
def test_a_v_the_schedule_cannot_run_is_refused(name, virtual, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        build(name, 2, 4, virtual)


@pytest.mark.parametrize("args,message", [
    ((0, 4, 2), "stages=0"),
    ((2, 0, 2), "microbatches=0"),
    ((2, 4, 0), "virtual=0"),
])
def test_builders_refuse_bad_sizes(args, message):
    for builder in (interleaved, looped_bfs):
        with pytest.raises(PlanError, match=message):
            builder(*args)
    with pytest.raises(PlanError, match="zbv holds exactly 2"):
        zbv(2, 4, 3)
