"""The hand-written plans `auto` weighs its own against (no torch import).

`generate`'s list scheduler is greedy: on some costs a hand-written schedule of the same
placement ends sooner (on the GPT bench's measured costs at p 2, V 2, m 8, the scheduler's plan
took 0.960 s simulated and DualPipeV's 0.879 s). So every registered schedule that places stages
as auto does (V = 1: gpipe, 1F1B, zero-bubble; V = 2: ZB-V, DualPipeV) is a candidate: `simulate()`
costs each on the same costs and transfer delay, and the shortest wins, auto's own on a tie. A
candidate must keep each stage's forwards, gradient passes and weight passes in micro-batch order,
as auto's own plans do (gradients then sum in the same order whichever plan wins, so two runs
planned on different measurements keep the same bits), and hold no more than the memory limit.
Of two equally short plans the one holding fewer activations wins; where the ranks share fewer
cores than there are ranks, "short" counts the cores (`Simulation.on_cores`). A candidate is
weighed as the runtime runs it, its first stage's backwards whole (`schedule.build` does that to
every plan): weighed split, a hand-written plan won by 2 % on costs where a split backward is
cheaper than a whole one, and as it ran it was longer than auto's own.
"""

from __future__ import annotations

from typing import Protocol

from brigade.pipeline.plans.action import V_SHAPE, B, F, I, Plan, PlanError, W
from brigade.pipeline.plans.registry import SCHEDULES, place
from brigade.pipeline.plans.schedule import compute_only, whole_first_backward
from brigade.pipeline.plans.simulate import simulate


class Costs(Protocol):
    """What a plan is priced on: `plans.costs.Costs` (per stage; see there)."""

    forward: tuple[float, ...]
    input_grad: tuple[float, ...]
    weight: tuple[float, ...]
    comm: float
    limit: int
    cores: float

    def whole(self, stage: int) -> float: ...


def or_handwritten(plan: Plan, p: int, m: int, v: int, costs: Costs) -> Plan:
    """`plan`, or the hand-written plan of the same placement that `simulate()` finds shorter on
    `costs` (module docstring), among those that keep micro-batch order and `costs.limit`; shorter
    on `costs.cores` shared cores where there are fewer than ranks (`Simulation.on_cores`), and
    of equally short plans the one that holds fewer activations.

    Args:
        plan: auto's own; p, m, v: its sizes; costs: what it was planned on (`plans.costs.Costs`).
    """
    def span(candidate: Plan) -> float:
        whole = [costs.whole(s) for s in range(p * v)]
        return simulate(candidate, list(costs.forward), whole, comm=costs.comm, weight=list(costs.weight),
                        input_grad=list(costs.input_grad)).on_cores(costs.cores)

    where, best, shortest, least = place(V_SHAPE, p, v), plan, span(plan), most_held(plan)
    for schedule in SCHEDULES.values():
        if schedule.costed or v not in schedule.virtuals(v) or place(schedule.placement, p, v) != where:
            continue
        try:
            # as the runtime runs it: stage 0's backwards whole (`build` does it to every plan)
            candidate = compute_only(whole_first_backward(schedule.build(p, m, v)))
        except PlanError:  # sizes it does not run
            continue
        if not in_order(candidate) or 0 < costs.limit < most_held(candidate):
            continue
        took, held = span(candidate), most_held(candidate)
        if took < shortest * (1 - 1e-9) or (took <= shortest * (1 + 1e-9) and held < least):
            best, shortest, least = candidate, took, held
    return best


def in_order(plan: Plan) -> bool:
    """Whether every stage runs its forwards, its gradient passes (B or I) and its weight passes
    (B or W) each in micro-batch order, as `auto`'s own plans do."""
    for acts in plan.values():
        seen: dict[tuple, int] = {}
        for a in acts:
            for kind in {F: ("F",), B: ("G", "W"), I: ("G",), W: ("W",)}[a.op]:
                if seen.get((a.stage, kind), -1) > a.microbatch:
                    return False
                seen[a.stage, kind] = a.microbatch
    return True


def most_held(plan: Plan) -> int:
    """The most micro-batch activations any rank holds at once, counted per stage it holds (as
    `Costs.limit` counts them): a forward holds one until its B or W."""
    most = 0
    for acts in plan.values():
        held = 0
        for a in acts:
            held += 1 if a.op == F else -1 if a.op in (B, W) else 0
            most = max(most, held)
    return most
