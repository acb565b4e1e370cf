"""Pipeline schedules as pure plans.

A plan maps each rank (one pipeline stage per rank) to the ordered list of
actions it performs in one training step. Plans are data: they are built,
checked (`validate`), costed (`simulate`) and drawn (`render`) without torch
and without processes. The runtime only interprets them.

    GPipe, 2 stages, 3 micro-batches (time across, ranks down):

    rank 0 | 0F0 0F1 0F2  .   .   .  0B0 0B1 0B2
    rank 1 |  .  1F0 1F1 1F2 1B0 1B1 1B2  .   .

Communication is not written by hand: `with_comms` inserts a SEND after every
compute action whose result a neighbour needs and a RECV before every compute
action that needs a neighbour's result.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from brigade.errors import BrigadeError

F, B = "F", "B"
I, W = "I", "W"  # noqa: E741 -- B split in two: input gradient (sent upstream), weight gradient
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE_OPS = (F, B, I, W)
COMM_OPS = (SEND_F, RECV_F, SEND_B, RECV_B)

Plan = dict[int, list["Action"]]

_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


class PlanError(BrigadeError, ValueError):
    """A plan that cannot run: the message names the offending action."""


@dataclass(frozen=True, order=True)
class Action:
    """One step of one stage: `op` on micro-batch `microbatch`. Prints as ``1F3``."""

    stage: int
    op: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op}{self.microbatch}"

    __repr__ = __str__

    @staticmethod
    def parse(text: str) -> Action:
        """Parse ``"1F3"`` or ``"0SEND_B2"`` back into an Action.

        Raises:
            PlanError: if the text is not an action.
        """
        match = _ACTION_RE.match(text.strip())
        if not match:
            raise PlanError(f"cannot parse action {text!r}: expected STAGE OP MB, like '1F3'")
        return Action(int(match[1]), match[2], int(match[3]))


def _check_sizes(n_stages: int, n_microbatches: int) -> None:
    if n_stages < 1:
        raise PlanError(f"stages={n_stages}: need at least 1 stage")
    if n_microbatches < 1:
        raise PlanError(f"microbatches={n_microbatches}: need at least 1 micro-batch")


def gpipe(n_stages: int, n_microbatches: int) -> Plan:
    """All forwards, then all backwards (GPipe). Peak memory holds m activations."""
    _check_sizes(n_stages, n_microbatches)
    mbs = range(n_microbatches)
    return {s: [Action(s, F, i) for i in mbs] + [Action(s, B, i) for i in mbs] for s in range(n_stages)}


def one_f_one_b(n_stages: int, n_microbatches: int) -> Plan:
    """1F1B (PipeDream-flush): a warm-up of forwards, then alternate, then drain.

    Stage s keeps at most p - s micro-batches in flight, so its activation
    memory is bounded by the depth of the pipeline, not by m. Works for m < p.
    """
    _check_sizes(n_stages, n_microbatches)
    plan: Plan = {}
    for s in range(n_stages):
        warmup = min(n_stages - 1 - s, n_microbatches)
        actions = [Action(s, F, i) for i in range(warmup)]
        for i in range(warmup, n_microbatches):
            actions += [Action(s, F, i), Action(s, B, i - warmup)]
        actions += [Action(s, B, i) for i in range(n_microbatches - warmup, n_microbatches)]
        plan[s] = actions
    return plan


def forward_only(n_stages: int, n_microbatches: int) -> Plan:
    """Inference: every stage runs the forwards in order, no backward."""
    _check_sizes(n_stages, n_microbatches)
    return {s: [Action(s, F, i) for i in range(n_microbatches)] for s in range(n_stages)}


def zero_bubble(n_stages: int, n_microbatches: int) -> Plan:
    """ZB-H1-style: 1F1B with each backward split into I (input gradient) and W (weight).

    Built by a greedy list schedule under unit costs: a stage runs an I as soon as
    its gradient is there, else a forward while it holds activations of at most
    p - s micro-batches (a micro-batch is held until its W: one more than 1F1B
    holds), else a pending W, which fills what would be bubble.
    """
    _check_sizes(n_stages, n_microbatches)
    p, m = n_stages, n_microbatches
    f_done = [[-1] * m for _ in range(p)]  # slot in which F / I finished, -1 = not yet
    i_done = [[-1] * m for _ in range(p)]
    next_f, next_i, w_count = [0] * p, [0] * p, [0] * p
    pending_w: list[list[int]] = [[] for _ in range(p)]
    plan: Plan = {s: [] for s in range(p)}
    t = 0
    while any(next_i[s] < m or pending_w[s] for s in range(p)):
        for s in range(p):
            i, f = next_i[s], next_f[s]
            grad_ready = s == p - 1 or -1 < i_done[s + 1][i] < t if i < m else False
            if i < f and -1 < f_done[s][i] < t and grad_ready:
                i_done[s][i], next_i[s] = t, i + 1
                pending_w[s].append(i)
                plan[s].append(Action(s, I, i))
            elif f < m and f - w_count[s] <= p - s and (s == 0 or -1 < f_done[s - 1][f] < t):
                f_done[s][f], next_f[s] = t, f + 1
                plan[s].append(Action(s, F, f))
            elif pending_w[s]:
                plan[s].append(Action(s, W, pending_w[s].pop(0)))
                w_count[s] += 1
        t += 1
    return plan


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb": zero_bubble}


def build(schedule: str, n_stages: int, n_microbatches: int) -> Plan:
    """Build a named schedule's plan.

    Raises:
        PlanError: for an unknown name or sizes below 1.
    """
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    return SCHEDULES[schedule](n_stages, n_microbatches)


def with_comms(plan: Plan) -> Plan:
    """Insert the sends and receives each compute action implies (a pure pass)."""
    last = max(plan)
    out: Plan = {}
    for rank, actions in plan.items():
        seq: list[Action] = []
        for a in actions:
            if a.op in COMM_OPS:
                raise PlanError(f"{a}: with_comms expects a compute-only plan")
            s, i = a.stage, a.microbatch
            if a.op == F:
                seq += [Action(s, RECV_F, i)] if s > 0 else []
                seq.append(a)
                seq += [Action(s, SEND_F, i)] if s < last else []
            elif a.op == W:
                seq.append(a)
            else:
                seq += [Action(s, RECV_B, i)] if s < last else []
                seq.append(a)
                seq += [Action(s, SEND_B, i)] if s > 0 else []
        out[rank] = seq
    return out


def compute_only(plan: Plan) -> Plan:
    return {r: [a for a in acts if a.op in COMPUTE_OPS] for r, acts in plan.items()}


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
