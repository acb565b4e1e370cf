"""`auto`'s hand-written candidates (`plans/handwritten.py`): auto runs a hand-written plan of its
placement where `simulate()` finds it shorter on the costs, its own on a tie, and never one that
breaks micro-batch order or the memory limit."""

import pytest

from brigade.pipeline.plans.action import B, F, I, W
from brigade.pipeline.plans.costs import Costs
from brigade.pipeline.plans.schedule import build, compute_only
from brigade.pipeline.plans.simulate import simulate
from brigade.pipeline.plans.validate import validate
from tests.pipeline.plans.test_generate import _held_at_once, _same_placement

# The GPT bench's measured per-stage seconds at p 2, V 2, m 8 (results/bench-gpt, auto's row,
# balance 3, 2, 2, 3): stage 0's input pass does nothing, its weight pass all.
GPT_V2 = Costs((0.01831, 0.01923, 0.01774, 0.01890), (0.00030, 0.02267, 0.02195, 0.02152),
               (0.03596, 0.01807, 0.01809, 0.01778), backward=(0.03564, 0.03469, 0.03433, 0.03460))


def _span(plan, c: Costs) -> float:
    return simulate(plan, list(c.forward), list(c.backward), comm=c.comm, weight=list(c.weight),
                    input_grad=list(c.input_grad)).makespan


@pytest.mark.parametrize("comm", [0.0, 0.005])
def test_auto_takes_the_hand_written_plan_its_greedy_search_misses(comm):
    # On these costs the list scheduler alone ended at 0.960 s (comm 0), DualPipeV at 0.879 s:
    # auto now runs as DualPipeV does (its own plan ties it on the costs rounded to 3 digits)
    from dataclasses import replace

    c = replace(GPT_V2, comm=comm)
    ours = _span(build("auto", 2, 8, 2, costs=c), c)
    theirs = {n: _span(build(n, 2, 8, 2), c) for n in _same_placement(2)}
    assert ours <= min(theirs.values()) * 1.001 and ours < 0.95 * theirs["zbv"]


def test_a_hand_written_candidate_keeps_micro_batch_order_and_the_memory_limit():
    from dataclasses import replace

    from brigade.pipeline.plans.action import Action
    from brigade.pipeline.plans.handwritten import in_order, most_held

    ok = {0: [Action(0, F, 0), Action(0, F, 1), Action(0, I, 0), Action(0, W, 0), Action(0, B, 1)]}
    assert in_order(ok) and most_held(ok) == 2
    # B1 adds micro-batch 1's weight gradients before W0 adds micro-batch 0's: another sum's order
    assert not in_order({0: [Action(0, F, 0), Action(0, F, 1), Action(0, I, 0), Action(0, B, 1),
                             Action(0, W, 0)]})
    assert not in_order({0: [Action(0, F, 1), Action(0, F, 0)]})
    assert not in_order({0: [Action(0, F, 0), Action(0, F, 1), Action(0, B, 1), Action(0, I, 0)]})
    assert not in_order({0: [Action(0, F, 0), Action(0, F, 1), Action(0, I, 0), Action(0, I, 1),
                             Action(0, W, 1), Action(0, W, 0)]})
    for limit in (2, 3):  # DualPipeV holds 4 on a rank at m 8: under a smaller limit it is no candidate
        plan = build("auto", 2, 8, 2, costs=replace(GPT_V2, limit=limit))
        validate(plan)
        assert max(_held_at_once(plan).values()) <= limit
    assert most_held(build("dualpipev", 2, 8, 2)) > 3


def test_on_a_tie_auto_keeps_its_own_plan():
    # unit costs, p 2, m 4: auto's own plan and zero-bubble's both end at 9, in different orders
    ours, zb = build("auto", 2, 4, 1), compute_only(build("zb", 2, 4))
    assert simulate(ours, 1.0, 1.0).makespan == simulate(zb, 1.0, 1.0).makespan == 9.0
    assert compute_only(ours) != zb


CASES = [  # costs (in auto's own units: the largest pass 1) on which a candidate wins, found by search
    (2, 6, 1, Costs((0.412, 1.0), (0.401, 0.88), (0.228, 0.885), (1.355, 2.28), 0.609)),  # B ≠ I + W
    (2, 8, 2, Costs((0.658, 0.682, 0.249, 0.585), (0.883, 0.791, 0.299, 0.553), (0.927, 1.0, 0.189, 0.74),
                    (1.556, 1.248, 0.536, 1.026), 0.106)),  # where a loop-placed plan would be shortest
    (3, 8, 1, Costs((0.662, 0.722, 0.436), (0.469, 0.996, 0.308), (0.842, 1.0, 0.144), (1.746, 1.102, 0.913),
                    0.639)),  # the transfer delay decides
    (3, 8, 2, Costs((0.493, 0.44, 0.931, 1.0, 0.245, 0.269), (0.321, 0.322, 0.558, 0.655, 0.35, 0.108),
                    (0.496, 0.449, 0.634, 0.996, 0.75, 0.586), (1.057, 1.035, 1.005, 2.509, 1.566, 1.041),
                    0.6)),  # forwards priced as forwards, not as backwards
]


SPANS = [17.611, 30.867, 23.045, 40.325]  # auto's makespan on each, priced on all its costs


@pytest.mark.parametrize("p, m, v, c, span", [(*case, s) for case, s in zip(CASES, SPANS)])
def test_auto_is_never_longer_than_a_candidate_priced_on_every_cost_it_has(p, m, v, c, span):
    from brigade.pipeline.plans.schedule import V_SHAPE, place

    plan = build("auto", p, m, v, costs=c)
    ours = _span(plan, c)
    assert ours == pytest.approx(span, abs=1e-3)  # its own plan or a candidate: the shortest of all
    assert all(ours <= _span(build(n, p, m, v), c) * (1 + 1e-9) for n in _same_placement(v))
    where = place(V_SHAPE, p, v)
    assert all(where[a.stage] == r for r, acts in plan.items() for a in acts)  # the V placement only


def test_most_held_counts_forwards_until_their_b_or_w_and_nothing_for_i():
    from brigade.pipeline.plans.action import Action
    from brigade.pipeline.plans.handwritten import most_held

    def acts(*ops):
        return {0: [Action(0, op, k) for op, k in ops]}
    assert most_held(acts((F, 0), (B, 0), (F, 1), (I, 1), (F, 2), (W, 1), (B, 2))) == 2
    assert most_held(acts((F, 0), (I, 0), (F, 1))) == 2  # I frees nothing
    assert most_held({0: []}) == 0


@pytest.mark.parametrize("v, limit", [(1, 1), (2, 5)])
def test_a_candidate_holding_more_than_the_limit_is_not_run_and_one_holding_it_is(v, limit):
    from dataclasses import replace

    from brigade.pipeline.plans.handwritten import most_held

    c = GPT_V2 if v == 2 else Costs(GPT_V2.forward[:2], GPT_V2.input_grad[:2], GPT_V2.weight[:2],
                                     backward=GPT_V2.backward[:2])
    plan = build("auto", 2, 8, v, costs=replace(c, limit=limit))
    assert max(_held_at_once(plan).values()) <= limit
    if v == 2:  # DualPipeV holds exactly 5 here: allowed, it is still the one auto runs
        assert most_held(compute_only(build("dualpipev", 2, 8, 2))) == 5
        assert _span(plan, c) == pytest.approx(_span(build("dualpipev", 2, 8, 2), c), rel=1e-3)


# ResNet-50 (64 px, micro-batch 4) cut 7, 6, 2, 3 at pp 4, each stage timed alone on one core
# (`measure.stages.stage_costs`): I + W costs 1.04–1.35 × B, so a split backward is more work.
RESNET_PP4 = Costs((0.0196, 0.0151, 0.0110, 0.0179), (0.0004, 0.0184, 0.0172, 0.0188),
                   (0.0291, 0.0289, 0.0330, 0.0349), backward=(0.0283, 0.0351, 0.0457, 0.0503))


def _ops(plan) -> set:
    return {a.op for acts in plan.values() for a in acts}


@pytest.mark.parametrize("m", [8, 16])
def test_on_shared_cores_auto_runs_a_whole_backward_where_the_split_is_more_work(m):
    from dataclasses import replace

    from brigade.pipeline.plans.schedule import SCHEDULES

    def on_two(plan) -> float:
        c = RESNET_PP4
        return simulate(plan, list(c.forward), list(c.backward), weight=list(c.weight),
                        input_grad=list(c.input_grad)).on_cores(2)

    alone = build("auto", 4, m, 1, costs=RESNET_PP4)  # a device a rank: the split fills the bubble
    assert {I, W} <= _ops(alone) and _span(alone, RESNET_PP4) < _span(build("1f1b", 4, m, 1), RESNET_PP4)
    shared = build("auto", 4, m, 1, costs=replace(RESNET_PP4, cores=2))  # 4 processes on 2 cores
    assert _ops(shared) == {F, B}
    candidates = [on_two(build(n, 4, m, 1)) for n in _same_placement(1) if not SCHEDULES[n].costed]
    assert on_two(shared) <= min(candidates) and on_two(shared) < 0.95 * on_two(alone)


def test_on_shared_cores_under_a_memory_limit_auto_still_weighs_every_candidate():
    from dataclasses import replace

    from brigade.pipeline.plans.handwritten import most_held

    # GPipe, the first candidate, holds 8 and is passed over at a limit of 4; 1F1B, after it, fits
    shared = build("auto", 4, 8, 1, costs=replace(RESNET_PP4, cores=2, limit=4))
    assert _ops(shared) == {F, B} and most_held(shared) <= 4


def test_of_equally_short_plans_auto_runs_the_one_holding_fewer_activations():
    from dataclasses import replace

    from brigade.pipeline.plans.handwritten import most_held

    # unit costs, 4 ranks on 2 cores: every plan's work ÷ 2 bounds it alike (48); 1F1B holds 4
    shared = build("auto", 4, 8, 1, costs=replace(Costs.unit(4), cores=2))
    assert most_held(shared) == most_held(build("1f1b", 4, 8, 1)) == 4 < most_held(build("zb", 4, 8, 1))
    assert most_held(build("auto", 4, 8, 1, costs=Costs.unit(4))) == 5  # its own plan is shorter alone
