"""The checks of a plan that the runtime relies on: `validate` it and insert its communication.

A plan comes from `schedule.py` or `virtual.py` (or by hand, in tests); nothing here runs torch
or processes (no torch import). `validate` checks every F before its B, every send paired with a receive,
neighbours agreeing on order, and no deadlock (by `timeline.execute`, every action costing 1).
Costing a plan is `simulate.py`; the bounds it is measured against, `bounds.py`.
"""

from __future__ import annotations

from brigade.pipeline.plans.action import COMM_OPS, Action, B, F, I, Plan, PlanError, W
from brigade.pipeline.plans.schedule import compute_only, stage_ranks, with_comms
from brigade.pipeline.plans.timeline import execute, grad_op


def _check_backwards(stage: int, seen: dict, n_mb: int) -> None:
    for i in range(n_mb):
        has_b, has_i, has_w = ((op, i) in seen for op in (B, I, W))
        if has_b and (has_i or has_w):
            raise PlanError(f"{Action(stage, B, i)} and a split backward {Action(stage, I, i)}/"
                            f"{Action(stage, W, i)} both present: use one or the other")
        if not has_b and not has_i:
            raise PlanError(f"stage {stage} never runs {Action(stage, B, i)}")
        if has_i != has_w:
            raise PlanError(f"stage {stage} never runs {Action(stage, W if has_i else I, i)}")


def placement_of(plan: Plan) -> dict[int, int]:
    """Stage → rank, checking that ranks are 0..R-1, stages 0..S-1, each stage on one rank."""
    if not plan:
        raise PlanError("empty plan: expected one action list per rank")
    if sorted(plan) != list(range(len(plan))):
        raise PlanError(f"ranks {sorted(plan)}: expected 0..{len(plan) - 1}")
    ranks: dict[int, int] = {}
    for r, acts in plan.items():
        for a in acts:
            if ranks.setdefault(a.stage, r) != r:
                raise PlanError(f"{a} is listed under rank {r} but stage {a.stage} runs on rank "
                                f"{ranks[a.stage]}: a stage lives on one rank")
    if sorted(ranks) != list(range(len(ranks))):
        missing = sorted(set(range(max(ranks, default=-1) + 1)) - set(ranks))
        raise PlanError(f"no rank runs stage {missing[0] if missing else 0}: stages must be 0..S-1")
    return ranks


def _check_structure(plan: Plan) -> tuple[int, int, bool]:
    """Placement, micro-batch ranges, F before B (or I before W). Returns (stages, m, training)."""
    ranks = placement_of(plan)
    by_stage: dict[int, list[Action]] = {s: [] for s in ranks}
    for r in plan:
        for a in plan[r]:
            by_stage[a.stage].append(a)
    n_mb = max((sum(a.op == F for a in acts) for acts in by_stage.values()), default=0)
    training = any(a.op in (B, I, W) for acts in plan.values() for a in acts)
    needs = {B: F, I: F, W: I}
    for stage, actions in by_stage.items():
        seen: dict[tuple[str, int], Action] = {}
        for a in actions:
            if not 0 <= a.microbatch < n_mb:
                raise PlanError(f"{a}: micro-batch out of range 0..{n_mb - 1}")
            if (a.op, a.microbatch) in seen:
                raise PlanError(f"{a} appears twice on rank {ranks[stage]}")
            before = needs.get(a.op)
            if before and (before, a.microbatch) not in seen:
                raise PlanError(f"{a} comes before {Action(stage, before, a.microbatch)}")
            seen[(a.op, a.microbatch)] = a
        for i in range(n_mb):
            if (F, i) not in seen:
                raise PlanError(f"stage {stage} never runs {Action(stage, F, i)}")
        if training:
            _check_backwards(stage, seen, n_mb)
    return len(ranks), n_mb, training


def _check_order(plan: Plan) -> None:
    """Stages on two ranks must agree on the order of what crosses between them (FIFO links)."""
    ranks = stage_ranks(plan)

    def seq(stage: int, forward: bool) -> list[Action]:
        return [a for a in plan[ranks[stage]] if a.stage == stage and (a.op == F if forward else grad_op(a))]

    for s in range(len(ranks) - 1):
        if ranks[s] == ranks[s + 1]:
            continue  # handed over by reference, found by micro-batch
        for forward, left, right in ((True, s, s + 1), (False, s + 1, s)):
            for k, (a, b) in enumerate(zip(seq(left, forward), seq(right, forward))):
                if a.microbatch != b.microbatch:
                    raise PlanError(
                        f"{b}: stage {right} runs micro-batch {b.microbatch} as its "
                        f"#{k} {'F' if forward else 'B'} but stage {left} produces {a.microbatch} "
                        "there; neighbouring stages must agree on order"
                    )


def validate(plan: Plan) -> Plan:
    """Check a plan and return it with communication inserted.

    Checks: each stage on one rank; every micro-batch's forward (and backward, in
    a training plan) exactly once per stage, forward before backward; stages on two
    ranks agree on the order of activations and gradients; sends pair with receives
    without deadlock (sends are asynchronous, receives block).

    Raises:
        PlanError: naming the first offending action.
    """
    if any(a.op in COMM_OPS for acts in plan.values() for a in acts):
        full = plan
        plan = compute_only(plan)
        if with_comms(plan) != full:
            expected = with_comms(plan)
            for r in full:
                for got, want in zip(full[r], expected[r]):
                    if got != want:
                        raise PlanError(f"rank {r}: found {got} where {want} belongs")
            raise PlanError("communication does not match the compute actions")
    _check_structure(plan)
    _check_order(plan)
    execute(plan, lambda r, op: 0.0 if op == "comm" else 1.0)
    return with_comms(plan)
