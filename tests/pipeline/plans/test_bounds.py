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
