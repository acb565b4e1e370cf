"""The pure checks of a plan: `validate` it, `simulate` it under costs, `render` it as a grid.

A plan comes from `schedule.py` (or by hand, in tests); nothing here runs torch or processes.
`validate` checks what the runtime relies on: every F before its B, every send paired with a
receive, neighbours agreeing on order, no deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from brigade.pipeline.schedule import (
    COMM_OPS,
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
    stage_ranks,
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
    peak_held: dict[int, int] = field(default_factory=dict)  # stage -> micro-batches held at once


def _grad_op(a: Action) -> bool:
    """The action that produces the gradient sent upstream: B, or I when B is split."""
    return a.op in (B, I)


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


def _placement(plan: Plan) -> dict[int, int]:
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
    ranks = _placement(plan)
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
        return [a for a in plan[ranks[stage]] if a.stage == stage and (a.op == F if forward else _grad_op(a))]

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


def _waiting_on(a: Action) -> Action:
    return Action(a.stage, RECV_F if a.op == F else RECV_B, a.microbatch)


def _execute(plan: Plan, cost) -> dict[int, list]:
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
                elif _grad_op(a) and s < last:
                    dep = (s + 1, "grad", a.microbatch)
                if dep is not None and dep not in done:
                    break
                delay = cost(s, "comm") if dep is not None and ranks[dep[0]] != r else 0.0
                start = max(clock[r], done[dep] + delay if dep is not None else 0.0)
                end = start + cost(s, a.op)
                done[(s, "grad" if _grad_op(a) else a.op, a.microbatch)] = end
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
    _execute(plan, lambda r, op: 0.0 if op == "comm" else 1.0)
    return with_comms(plan)


def simulate(plan: Plan, forward, backward=None, comm: float = 0.0, weight=None,
             input_grad=None) -> Simulation:
    """Cost a plan: when each action runs, the makespan, and the bubble.

    Args:
        plan: a valid plan (compute-only or with comms).
        forward: per-micro-batch forward cost, one float for all stages or a list per stage
            (indexed by stage: P·V entries when ranks hold several stages).
        backward: same for a whole backward (B); defaults to the forward costs.
        comm: delay between a stage finishing and its neighbour being able to start.
        weight: for split backwards, the W part of `backward` (I costs the rest);
            defaults to half of it.
        input_grad: the I part of a split backward, when measured: splitting a backward in two
            passes costs more than one (on CPU, the benches' last stages: I + W = 1.01-1.10 × B),
            so measured costs give both halves; without it I = `backward` − `weight`.

    Returns:
        Simulation with makespan, per-rank timeline (action, start, end), busy
        time, idle time and bubble fraction = idle / (ranks × makespan).
    """
    plan = compute_only(validate(plan))
    backward = forward if backward is None else backward

    def cost(stage: int, op: str) -> float:
        if op == "comm":
            return comm
        if op == F:
            return _per_stage(forward, stage)
        b = _per_stage(backward, stage)
        i, w = _halves(b, stage, weight, input_grad)
        return {B: b, I: i, W: w}[op]

    timeline = _execute(plan, cost)
    makespan = max((end for tl in timeline.values() for _, _, end in tl), default=0.0)
    busy = {r: sum(e - s for _, s, e in tl) for r, tl in timeline.items()}
    idle = {r: makespan - b for r, b in busy.items()}
    total = makespan * len(plan)
    bubble = sum(idle.values()) / total if total else 0.0
    return Simulation(makespan, timeline, busy, bubble, idle, peak_held(plan))


def lower_bound(plan: Plan, forward, backward=None, weight=None, input_grad=None) -> float:
    """The shortest step that any plan with `plan`'s stages, placement and micro-batch count can
    take on these costs (as `simulate` takes them), transfers free.

    No rank ends before it has run its stages' m forwards and m backwards (a whole B, or I + W,
    whichever is cheaper), nor starts before micro-batch 0's forward has reached its first
    stage; and one micro-batch must pass forward through every stage and back. Whatever the
    order of actions, simulate()'s makespan is at least this: how far a better schedule could go.
    """
    where, m, fwd, grad, whole = _least_costs(plan, forward, backward, weight, input_grad)
    bound = sum(fwd) + sum(grad)
    for r in set(where.values()):
        mine = [s for s, q in where.items() if q == r]
        bound = max(bound, sum(fwd[:min(mine)]) + m * sum(fwd[s] + whole[s] for s in mine))
    return bound


def balanced_bound(plan: Plan, forward, backward=None, weight=None, input_grad=None) -> float:
    """The plan's least compute spread evenly over its ranks: what no cut of the same blocks into
    any number of stages per rank, and no schedule, can beat (transfers free)."""
    where, m, fwd, _, whole = _least_costs(plan, forward, backward, weight, input_grad)
    return m * sum(f + b for f, b in zip(fwd, whole)) / len(set(where.values()))


def _least_costs(plan: Plan, forward, backward, weight, input_grad):
    """(stage → rank, m, per stage: forward, least gradient-to-send pass, least whole backward)."""
    where = _placement(compute_only(plan))
    n, m = len(where), sum(a.op == F for acts in plan.values() for a in acts) // len(where)
    fwd = [_per_stage(forward, s) for s in range(n)]
    whole = [_per_stage(forward if backward is None else backward, s) for s in range(n)]
    halves = [_halves(b, s, weight, input_grad) for s, b in enumerate(whole)]
    return (where, m, fwd, [min(b, i) for b, (i, _) in zip(whole, halves)],
            [min(b, i + w) for b, (i, w) in zip(whole, halves)])


def _halves(b: float, stage: int, weight, input_grad) -> tuple[float, float]:
    """(I, W) of a backward costing `b`: measured, or I = b - W with W half of b by default."""
    if input_grad is not None:
        return _per_stage(input_grad, stage), _per_stage(weight, stage)
    w = b / 2 if weight is None else min(_per_stage(weight, stage), b)
    return b - w, w


def _per_stage(c, stage: int) -> float:
    return float(c[stage]) if isinstance(c, (list, tuple)) else float(c)


def peak_held(plan: Plan) -> dict[int, int]:
    """Per stage, the most micro-batches whose activations it holds at once (F done, B or W not).

    Memory in units of one micro-batch's activations of that stage: what a schedule costs in
    memory, independent of the model (GPipe: m; 1F1B: p - s on stage s).
    """
    held: dict[int, int] = {}
    peak: dict[int, int] = {}
    for acts in compute_only(plan).values():
        for a in acts:
            if a.op == F:
                held[a.stage] = held.get(a.stage, 0) + 1
                peak[a.stage] = max(peak.get(a.stage, 0), held[a.stage])
            elif a.op in (B, W):
                held[a.stage] -= 1
    return dict(sorted(peak.items()))


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
