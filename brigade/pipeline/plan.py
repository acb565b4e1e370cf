"""The pure checks of a plan: `validate` it, `simulate` it under costs, `render` it as a grid.

A plan comes from `schedule.py` (or by hand, in tests); nothing here runs torch or processes.
`validate` checks what the runtime relies on: every F before its B, every send paired with a
receive, neighbours agreeing on order, no deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from brigade.pipeline.schedule import (
    COMM_OPS,
    COMPUTE_OPS,
    RECV_B,
    RECV_F,
    Action,
    B,
    F,
    I,
    Plan,
    PlanError,
    W,
    compute_only,
    with_comms,
)


@dataclass
class Simulation:
    """Result of `simulate`: times are in the units of the costs given."""

    makespan: float
    timeline: dict[int, list[tuple[Action, float, float]]]
    busy: dict[int, float]
    bubble_fraction: float
    idle: dict[int, float] = field(default_factory=dict)


def _grad_op(a: Action) -> bool:
    """The action that produces the gradient sent upstream: B, or I when B is split."""
    return a.op in (B, I)


def _check_backwards(rank: int, seen: dict, n_mb: int) -> None:
    for i in range(n_mb):
        if (F, i) not in seen:
            raise PlanError(f"rank {rank} never runs {Action(rank, F, i)}")
        has_b, has_i, has_w = ((op, i) in seen for op in (B, I, W))
        if has_b and (has_i or has_w):
            raise PlanError(f"{Action(rank, B, i)} and a split backward {Action(rank, I, i)}/"
                            f"{Action(rank, W, i)} both present: use one or the other")
        if not has_b and not has_i:
            raise PlanError(f"rank {rank} never runs {Action(rank, B, i)}")
        if has_i != has_w:
            missing = Action(rank, W if has_i else I, i)
            raise PlanError(f"rank {rank} never runs {missing}")


def _check_structure(plan: Plan) -> tuple[int, int, bool]:
    """Stage/rank agreement, micro-batch ranges, F before B (or I before W). Returns (p, m, training)."""
    if not plan:
        raise PlanError("empty plan: expected one action list per rank")
    n_stages = len(plan)
    if sorted(plan) != list(range(n_stages)):
        raise PlanError(f"ranks {sorted(plan)}: expected 0..{n_stages - 1}")
    fwd = {r: [a.microbatch for a in acts if a.op == F] for r, acts in plan.items()}
    n_mb = max((len(v) for v in fwd.values()), default=0)
    training = any(a.op in (B, I, W) for acts in plan.values() for a in acts)
    needs = {B: F, I: F, W: I}
    for rank, actions in plan.items():
        seen: dict[tuple[str, int], Action] = {}
        for a in actions:
            if a.stage != rank:
                raise PlanError(f"{a} is listed under rank {rank}: one stage per rank")
            if not 0 <= a.microbatch < n_mb:
                raise PlanError(f"{a}: micro-batch out of range 0..{n_mb - 1}")
            if a.op in COMPUTE_OPS:
                if (a.op, a.microbatch) in seen:
                    raise PlanError(f"{a} appears twice on rank {rank}")
                before = needs.get(a.op)
                if before and (before, a.microbatch) not in seen:
                    raise PlanError(f"{a} comes before {Action(rank, before, a.microbatch)}")
            seen[(a.op, a.microbatch)] = a
        if training:
            _check_backwards(rank, seen, n_mb)
        else:
            for i in range(n_mb):
                if (F, i) not in seen:
                    raise PlanError(f"rank {rank} never runs {Action(rank, F, i)}")
    return n_stages, n_mb, training


def _check_order(plan: Plan) -> None:
    """Neighbours must agree on the order of what crosses between them (FIFO links)."""
    def seq(rank: int, forward: bool) -> list[Action]:
        return [a for a in plan[rank] if (a.op == F if forward else _grad_op(a))]

    for s in range(len(plan) - 1):
        for forward, left, right in ((True, s, s + 1), (False, s + 1, s)):
            for k, (a, b) in enumerate(zip(seq(left, forward), seq(right, forward))):
                if a.microbatch != b.microbatch:
                    raise PlanError(
                        f"{b}: stage {right} runs micro-batch {b.microbatch} as its "
                        f"#{k} {'F' if forward else 'B'} but stage {left} produces {a.microbatch} "
                        "there; neighbouring stages must agree on order"
                    )


def _waiting_on(a: Action) -> Action:
    return Action(a.stage, RECV_F if a.op == F else RECV_B, a.microbatch)


def _execute(plan: Plan, cost) -> dict[int, list]:
    """List-schedule the compute actions; sends never block, receives wait.

    `cost(rank, op)` is an action's duration; `cost(rank, "comm")` the link delay.
    Raises PlanError naming every blocked action if no rank can progress.
    """
    last = len(plan) - 1
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
                dep = None
                if a.op == F and r > 0:
                    dep = (r - 1, F, a.microbatch)
                elif _grad_op(a) and r < last:
                    dep = (r + 1, "grad", a.microbatch)
                if dep is not None and dep not in done:
                    break
                ready = done[dep] + cost(r, "comm") if dep is not None else 0.0
                start = max(clock[r], ready)
                end = start + cost(r, a.op)
                done[(r, "grad" if _grad_op(a) else a.op, a.microbatch)] = end
                clock[r] = end
                timeline[r].append((a, start, end))
                pos[r] += 1
                progressed = True
        if not progressed:
            blocked = [str(_waiting_on(acts[r][pos[r]])) for r in plan if pos[r] < len(acts[r])]
            raise PlanError(f"deadlock: ranks wait forever at {', '.join(blocked)}")
    return timeline


def validate(plan: Plan) -> Plan:
    """Check a plan and return it with communication inserted.

    Checks: one stage per rank; every micro-batch's forward (and backward, in
    a training plan) exactly once, forward before backward; neighbours agree on
    the order of activations and gradients; sends pair with receives without
    deadlock (sends are asynchronous, receives block).

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
    _execute(plan, lambda r, op: 0.0 if op == "comm" else 1.0)
    return with_comms(plan)


def simulate(plan: Plan, forward, backward=None, comm: float = 0.0, weight=None) -> Simulation:
    """Cost a plan: when each action runs, the makespan, and the bubble.

    Args:
        plan: a valid plan (compute-only or with comms).
        forward: per-micro-batch forward cost, one float for all stages or a list per stage.
        backward: same for a whole backward (B); defaults to the forward costs.
        comm: delay between a stage finishing and its neighbour being able to start.
        weight: for split backwards, the W part of `backward` (I costs the rest);
            defaults to half of it.

    Returns:
        Simulation with makespan, per-rank timeline (action, start, end), busy
        time, idle time and bubble fraction = idle / (ranks × makespan).
    """
    plan = compute_only(validate(plan))
    backward = forward if backward is None else backward

    def per_stage(c, r: int) -> float:
        return float(c[r]) if isinstance(c, (list, tuple)) else float(c)

    def cost(r: int, op: str) -> float:
        if op == "comm":
            return comm
        if op == F:
            return per_stage(forward, r)
        b = per_stage(backward, r)
        w = b / 2 if weight is None else min(per_stage(weight, r), b)
        return {B: b, I: b - w, W: w}[op]

    timeline = _execute(plan, cost)
    makespan = max((end for tl in timeline.values() for _, _, end in tl), default=0.0)
    busy = {r: sum(e - s for _, s, e in tl) for r, tl in timeline.items()}
    idle = {r: makespan - b for r, b in busy.items()}
    total = makespan * len(plan)
    bubble = sum(idle.values()) / total if total else 0.0
    return Simulation(makespan, timeline, busy, bubble, idle)


def render(plan: Plan, forward: float = 1.0, backward: float = 1.0) -> str:
    """ASCII grid of a plan: time across, ranks down.

    One column is the shortest action's duration; a longer action fills its
    first column with its name and the rest with ``~``.
    """
    sim = simulate(plan, forward, backward)
    durations = [e - s for tl in sim.timeline.values() for _, s, e in tl if e > s]
    unit = min(durations, default=1.0)
    width = max(len(str(a)) for acts in plan.values() for a in acts) + 1
    slots = int(round(sim.makespan / unit))
    lines = ["t      | " + "".join(f"{t:<{width}}" for t in range(slots))]
    for r, tl in sim.timeline.items():
        cells = ["." for _ in range(slots)]
        for a, start, end in tl:
            first, last = int(round(start / unit)), int(round(end / unit))
            for t in range(first, last):
                cells[t] = str(a) if t == first else "~"
        lines.append(f"rank {r:<2}| " + "".join(f"{c:<{width}}" for c in cells))
    lines.append(f"bubble {sim.bubble_fraction:.3f}  makespan {sim.makespan:g}")
    return "\n".join(line.rstrip() for line in lines)
