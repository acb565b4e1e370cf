"""When each action of a plan runs, given costs: the list scheduler that both `validate` (for
deadlocks, every action costing 1) and `simulate` (under measured or assumed costs) run.

Sends never block and receives wait: a rank runs its next compute action as soon as what it
needs has arrived (the previous stage's forward, the next stage's gradient), plus the link
delay when that came from another rank. No torch import.
"""

from __future__ import annotations

from brigade.pipeline.plans.action import RECV_B, RECV_F, Action, B, F, I, Plan, PlanError
from brigade.pipeline.plans.schedule import compute_only, stage_ranks


def grad_op(a: Action) -> bool:
    """The action that produces the gradient sent upstream: B, or I when B is split."""
    return a.op in (B, I)


def _waiting_on(a: Action) -> Action:
    return Action(a.stage, RECV_F if a.op == F else RECV_B, a.microbatch)


def execute(plan: Plan, cost) -> dict[int, list]:
    """List-schedule the compute actions; sends never block, receives wait.

    `cost(stage, op)` is an action's duration; `cost(stage, "comm")` the link delay
    (paid only between stages on different ranks).
    Raises PlanError naming every blocked action if no rank can progress.
    """
    ranks = stage_ranks(plan)
    last = max(ranks, default=0)
    done: dict[tuple[int, str, int], float] = {}
    pos = {r: 0 for r in plan}
    clock = {r: 0.0 for r in plan}
    timeline: dict[int, list] = {r: [] for r in plan}
    acts = compute_only(plan)
    while any(pos[r] < len(acts[r]) for r in plan):
        progressed = False
        for r in plan:
            while pos[r] < len(acts[r]):
                a = acts[r][pos[r]]
                s, dep = a.stage, None
                if a.op == F and s > 0:
                    dep = (s - 1, F, a.microbatch)
                elif grad_op(a) and s < last:
                    dep = (s + 1, "grad", a.microbatch)
                if dep is not None and dep not in done:
                    break
                delay = cost(s, "comm") if dep is not None and ranks[dep[0]] != r else 0.0
                start = max(clock[r], done[dep] + delay if dep is not None else 0.0)
                end = start + cost(s, a.op)
                done[(s, "grad" if grad_op(a) else a.op, a.microbatch)] = end
                clock[r] = end
                timeline[r].append((a, start, end))
                pos[r] += 1
                progressed = True
        if not progressed:
            blocked = [str(_waiting_on(acts[r][pos[r]])) for r in plan if pos[r] < len(acts[r])]
            raise PlanError(f"deadlock: ranks wait forever at {', '.join(blocked)}")
    return timeline
