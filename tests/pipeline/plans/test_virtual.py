"""Several stages per rank: interleaved 1F1B, looped BFS, ZB-V and DualPipeV as pure plans.

Each plan is checked like the one-stage schedules (validate, simulate, NCCL posting) over a
grid of ranks × stages per rank × micro-batches, and each bubble against its paper.
"""

import itertools
import re

import pytest
import torch

from brigade.pipeline.batches import microbatch
from brigade.pipeline.plans.action import PlanError
from brigade.pipeline.plans.schedule import SCHEDULES, build, one_f_one_b, place, stage_ranks
from brigade.pipeline.plans.simulate import render, simulate
from brigade.pipeline.plans.validate import validate
from brigade.pipeline.plans.virtual import dualpipev, groups, interleaved, looped_bfs, zbv
from brigade.pipeline.runtime import interpreter
from brigade.pipeline.transport import nccl, ordering
from tests.pipeline.runtime.test_interpreter import data, make_blocks, run_stages, split_stages

RANKS, MICROBATCHES, VIRTUALS = (1, 2, 3, 4), (1, 2, 3, 4, 5, 8), (1, 2, 3)
LOOPED = ("interleaved", "looped-bfs")


def grid(name):
    """(p, V, m) for every V the schedule runs."""
    return list(itertools.product(RANKS, SCHEDULES[name].virtuals(max(VIRTUALS)), MICROBATCHES))


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
    with pytest.raises(PlanError, match="dualpipev holds exactly 2"):
        dualpipev(2, 4, 3)
    with pytest.raises(PlanError, match="microbatches=0"):
        dualpipev(2, 0)


def test_dualpipev_two_ranks_four_microbatches():
    """Full backwards (B) in the steady state; split I/W only in the warm-up (3I0 3W0) and
    the drain, where the W's fill what would be idle."""
    assert plan_str(dualpipev(2, 4)) == {
        0: "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3",
        1: "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3",
    }


def _torch_dualpipev(p, m):
    """torch's per-rank DualPipeV order, its overlapped (F; B) pairs as F then B. The builder
    only reads the two sizes, so no stages or process group are needed."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    sizes = SimpleNamespace(pp_group_size=p, _n_microbatches=m)
    out = {}
    for r in range(p):
        acts = ScheduleDualPipeV._calculate_single_rank_operations(sizes, r)
        out[r] = " ".join(str(x) for a in acts for x in (a.sub_actions or (a,)))
    return out


@pytest.mark.parametrize("p,m", [(2, 4), (3, 7), (4, 8)])
def test_dualpipev_order_is_torchs(p, m):
    assert plan_str(dualpipev(p, m)) == _torch_dualpipev(p, m)


def test_dualpipev_is_valid_placed_and_runs_under_nccl_for_any_m():
    """torch needs m ≥ 2p; brigade leaves the phases with negative counts empty and drops the
    actions of micro-batches ≥ m, so m = 1 .. 2p-1 run too."""
    for p, m in itertools.product(RANKS, range(1, 10)):
        plan = validate(dualpipev(p, m))
        assert stage_ranks(plan) == dict(enumerate(place("v", p, 2))), (p, m)
        for mode in ordering.MODES:
            nccl.check(plan, "grouped", mode)


@pytest.mark.parametrize("p", (2, 3, 4))
def test_dualpipev_bubble_is_zbvs_with_fewer_split_backwards(p):
    """With F = I = W = 1 (B = 2) and m ≥ 2p, DualPipeV idles as little as ZB-V (the ramp down
    the V, p-1 slots a rank) while splitting only 2p-1-r of rank r's 2m backwards, whatever
    m: the rest are full B's, so a split's overhead is paid rarely. It holds one stage
    activation more than ZB-V per rank (2p+1: each steady step runs its F before its B), the
    same per stage. Below 2p micro-batches (torch refuses them) it still beats 1F1B's bubble."""
    for m in range(1, 3 * p + 1):
        sim = simulate(dualpipev(p, m), 1.0, 2.0, weight=1.0)
        if m < 2 * p:
            assert sim.bubble_fraction < (p - 1) / (m + p - 1), (p, m)
            continue
        ref = simulate(zbv(p, m), 1.0, 2.0, weight=1.0)
        assert sim.makespan == ref.makespan and sim.idle == {r: p - 1 for r in range(p)}, (p, m)
        assert sim.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1))
        assert sim.peak_held == ref.peak_held
        assert rank_peak(dualpipev(p, m)) == {r: 2 * p + 1 for r in range(p)}
        splits = {r: sum(a.op == "I" for a in acts) for r, acts in dualpipev(p, m).items()}
        assert splits == {r: 2 * p - 1 - r for r in range(p)}, (p, m)
    # m < 2p runs torch's phases with the negative counts empty, not built for 2p and cut back
    # as zbv is (that would idle 0.273 here): ZB-V's own bubble at p = m = 4
    four = simulate(dualpipev(4, 4), 1.0, 2.0, weight=1.0).bubble_fraction
    assert four == pytest.approx(simulate(zbv(4, 4), 1.0, 2.0, weight=1.0).bubble_fraction) == 0.2


class _RecordingReducer:
    """Stands in for a stage's GradientReducer: notes each parameter's gradient when the runtime
    calls it complete, to compare with the gradient at the end of the step."""

    def __init__(self, params):
        self.params, self.at_ready = list(params), {}

    def reset(self):
        pass

    def ready(self, params):
        for p in params:
            assert id(p) not in self.at_ready, "a parameter reported ready twice"
            self.at_ready[id(p)] = p.grad.clone()

    def finish(self):
        pass


@pytest.mark.parametrize("p,m", [(2, 4), (3, 5)])
def test_dualpipev_reports_every_stage_ready_once_its_gradients_are_final(monkeypatch, p, m):
    """Data parallel: a stage's all-reduce starts when its last backward pass is done, a W
    (split) or a B (full, e.g. stage 3 at p = 2: 3W0 ... 3B3). Ready must come exactly once,
    with the step's final gradient."""
    reducers = {}
    init = interpreter.StageRunner.__init__

    def with_reducers(self, modules, *args, **kwargs):
        init(self, modules, *args, **kwargs)
        self.reducers = {s: _RecordingReducer(mod.parameters()) for s, mod in self.modules.items()}
        reducers.update(self.reducers)

    monkeypatch.setattr(interpreter.StageRunner, "__init__", with_reducers)
    plan = validate(dualpipev(p, m))
    x, y = data()
    run_stages(plan, split_stages(make_blocks(2 * p), 2 * p), microbatch.split(x, m),
               microbatch.split(y, m), microbatch.weights(len(x), m))
    last_ops = {a.stage: a.op for acts in plan.values() for a in acts if a.op in "BW"}
    assert {"B", "W"} <= set(last_ops.values())  # both kinds end some stage's step
    assert sorted(reducers) == list(range(2 * p))
    for s, red in reducers.items():
        assert len(red.at_ready) == len(red.params), f"stage {s}: not every parameter reported"
        for q in red.params:
            torch.testing.assert_close(red.at_ready[id(q)], q.grad, rtol=0, atol=0)


def test_zbv_with_fewer_microbatches_than_the_v_holds_is_built_for_2p_minus_1_and_cut_back():
    """m = 2 < 2p - 1 = 3: the plan is the m = 3 one without micro-batch 2's actions."""
    assert plan_str(zbv(2, 2)) == {
        0: "0F0 0F1 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 0I1 0W1",
        1: "1F0 2F0 1F1 2F1 2I0 2W0 1I0 1W0 2I1 2W1 1I1 1W1",
    }
    assert {r: [a for a in acts if a.microbatch < 2] for r, acts in zbv(2, 3).items()} == zbv(2, 2)
