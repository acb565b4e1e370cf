"""`lower_bound`: no plan of any registered schedule beats it, and it is reached where nothing overlaps."""

from brigade.pipeline.plans.action import PlanError
from brigade.pipeline.plans.bounds import lower_bound
from brigade.pipeline.plans.schedule import SCHEDULES, build
from brigade.pipeline.plans.simulate import simulate


def test_no_plan_beats_the_lower_bound():
    """lower_bound() holds for every schedule, p, V and m on random costs (split backwards
    dearer or cheaper than whole ones), and is reached where nothing can overlap."""
    import random



    rng = random.Random(0)
    for name in SCHEDULES:
        for p in (1, 2, 3, 4):
            for m in (1, 2, 3, 5, 8):
                try:
                    plan = build(name, p, m)
                except PlanError:
                    continue  # a V or an m the schedule refuses
                n = len({a.stage for acts in plan.values() for a in acts})
                for _ in range(3):
                    f = [rng.uniform(0.5, 2) for _ in range(n)]
                    b = [rng.uniform(1, 4) for _ in range(n)]
                    w = [rng.uniform(0.1, 0.9) * x for x in b]
                    i = [x - y + rng.uniform(-0.2, 0.3) for x, y in zip(b, w)]
                    got = simulate(plan, f, b, weight=w, input_grad=i).makespan
                    assert lower_bound(plan, f, b, weight=w, input_grad=i) <= got + 1e-9, (name, p, m)
                    got = simulate(plan, f, b, weight=w).makespan  # I = B - W
                    assert lower_bound(plan, f, b, weight=w) <= got + 1e-9, (name, p, m)
                    assert lower_bound(plan, f, b) <= simulate(plan, f, b).makespan + 1e-9
    one = build("gpipe", 1, 4)
    assert lower_bound(one, 1.0, 2.0) == simulate(one, 1.0, 2.0).makespan == 12.0
    # 1F1B, p = 2, m = 4, F = B = 1: rank 1 starts after one F, then has 8 of work (the plan: 10)
    assert lower_bound(build("1f1b", 2, 4), 1.0, 1.0) == 9.0
    # a split backward cheaper than the whole one bounds with I + W
    assert lower_bound(one, 1.0, 2.0, weight=0.5, input_grad=1.0) == 4 * (1.0 + 1.5)


def test_one_micro_batch_through_every_stage_and_back_bounds_a_short_step():
    """With one micro-batch on three ranks no rank has much work: the bound is the micro-batch's
    way down and back, 3 F and 3 of the cheaper of B and I (were I dearer than B, 3 B), which
    GPipe reaches; no rank's own work (at most 2 F waited for, then 1 F + 1 B) comes near it."""
    plan = build("gpipe", 3, 1)
    assert lower_bound(plan, 1.0, 1.0, weight=1.0, input_grad=1.0) == simulate(plan, 1.0).makespan == 6.0
    # by default I = B - W = B / 2: 3 F + 3 I; the backward defaults to the forward
    assert lower_bound(plan, 1.0, 1.0) == lower_bound(plan, 1.0) == 4.5


def test_balanced_bound_spreads_the_least_compute_over_the_ranks():
    from brigade.pipeline.plans.bounds import balanced_bound
    from brigade.pipeline.plans.schedule import gpipe

    # m · Σ (F + B) / ranks = 4 · (1 + 2 + 3 + 6) / 2
    assert balanced_bound(gpipe(2, 4), [1.0, 3.0], [2.0, 6.0]) == 24.0
    # I + W cheaper than B: 4 · (1 + 1.5 + 3 + 3) / 2
    assert balanced_bound(gpipe(2, 4), [1.0, 3.0], [2.0, 6.0], weight=[0.5, 1.0],
                          input_grad=[1.0, 2.0]) == 17.0
    # the backward defaults to the forward; four stages on two ranks: 4 · 4 · 2 / 2
    assert balanced_bound(build("interleaved", 2, 4), 1.0) == 16.0
    # V placement, m = 3, per stage the cheaper of B and I + W: 3 · (2.5 + 3.5 + 5 + 6) / 2
    assert balanced_bound(build("zbv", 2, 3), [1.0, 2.0, 3.0, 4.0], 2.0, weight=1.0,
                          input_grad=[0.5, 0.5, 2.0, 2.0]) == 25.5
