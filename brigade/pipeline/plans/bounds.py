"""How short a step could be: the bounds a plan's simulated makespan is measured against.

`lower_bound` is what any order of the same stages, placement and micro-batches must take;
`balanced_bound` what no cut of the same blocks into stages and no schedule can beat. Both
take costs as `simulate` does, transfers free. No torch import.
"""

from __future__ import annotations

from brigade.pipeline.plans.action import F, Plan
from brigade.pipeline.plans.schedule import compute_only
from brigade.pipeline.plans.simulate import halves, per_stage
from brigade.pipeline.plans.validate import placement_of


def lower_bound(plan: Plan, forward, backward=None, weight=None, input_grad=None) -> float:
    """The shortest step that any plan with `plan`'s stages, placement and micro-batch count can
    take on these costs (as `simulate` takes them), transfers free.

    No rank ends before it has run its stages' m forwards and m backwards (a whole B, or I + W,
    whichever is cheaper), nor starts before micro-batch 0's forward has reached its first
    stage; and one micro-batch must pass forward through every stage and back. Whatever the
    order of actions, simulate()'s makespan is at least this: how far a better schedule could go.
    """
    where, m, fwd, grad, whole = _least_costs(plan, forward, backward, weight, input_grad)
    return stage_bound([where[s] for s in range(len(where))], m, fwd, grad, whole)


def stage_bound(where, m: int, fwd, grad, whole) -> float:
    """`lower_bound` from per-stage costs and the placement, with no plan built: what auto's cut
    search (`cuts.choose_cut`) weighs thousands of cuts by before it plans any.

    Args:
        where: each stage's rank, stage 0 first. m: micro-batches.
        fwd, grad, whole: per stage, the forward, the least pass that sends a gradient upstream
            (B or I) and the least whole backward (B, or I + W).
    """
    return max(sum(fwd) + sum(grad), *rank_bounds(where, m, fwd, whole).values())


def rank_bounds(where, m: int, fwd, whole) -> dict[int, float]:
    """Per rank, the least time it takes (`lower_bound`'s term): the forwards before its first
    stage, then its stages' m forwards and m backwards. The cut search descends on all of them,
    not only the largest, so that it leaves a plateau of the bound where the busiest rank stays
    as busy while another gets lighter."""
    first: dict[int, int] = {}
    work: dict[int, float] = {}
    for s, r in enumerate(where):
        first.setdefault(r, s)
        work[r] = work.get(r, 0.0) + fwd[s] + whole[s]
    return {r: sum(fwd[:s]) + m * work[r] for r, s in first.items()}


def balanced_bound(plan: Plan, forward, backward=None, weight=None, input_grad=None) -> float:
    """The plan's least compute spread evenly over its ranks: what no cut of the same blocks into
    any number of stages per rank, and no schedule, can beat (transfers free)."""
    where, m, fwd, _, whole = _least_costs(plan, forward, backward, weight, input_grad)
    return m * sum(f + b for f, b in zip(fwd, whole)) / len(set(where.values()))


def _least_costs(plan: Plan, forward, backward, weight, input_grad):
    """(stage → rank, m, per stage: forward, least gradient-to-send pass, least whole backward)."""
    where = placement_of(compute_only(plan))
    n, m = len(where), sum(a.op == F for acts in plan.values() for a in acts) // len(where)
    fwd = [per_stage(forward, s) for s in range(n)]
    whole = [per_stage(forward if backward is None else backward, s) for s in range(n)]
    parts = [halves(b, s, weight, input_grad) for s, b in enumerate(whole)]
    return (where, m, fwd, [min(b, i) for b, (i, _) in zip(whole, parts)],
            [min(b, i + w) for b, (i, w) in zip(whole, parts)])
