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
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE_OPS = (F, B)
COMM_OPS = (SEND_F, RECV_F, SEND_B, RECV_B)

Plan = dict[int, list["Action"]]

_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B)(\d+)$")


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


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


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


def _check_structure(plan: Plan) -> tuple[int, int, bool]:
    """Stage/rank agreement, micro-batch ranges, F-before-B. Returns (p, m, training)."""
    if not plan:
        raise PlanError("empty plan: expected one action list per rank")
    n_stages = len(plan)
    if sorted(plan) != list(range(n_stages)):
        raise PlanError(f"ranks {sorted(plan)}: expected 0..{n_stages - 1}")
    fwd = {r: [a.microbatch for a in acts if a.op == F] for r, acts in plan.items()}
    n_mb = max((len(v) for v in fwd.values()), default=0)
    training = any(a.op == B for acts in plan.values() for a in acts)
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
                if a.op == B and (F, a.microbatch) not in seen:
                    raise PlanError(f"{a} comes before its forward {Action(rank, F, a.microbatch)}")
            seen[(a.op, a.microbatch)] = a
        for i in range(n_mb):
            for op in (F, B) if training else (F,):
                if (op, i) not in seen:
                    raise PlanError(f"rank {rank} never runs {Action(rank, op, i)}")
    return n_stages, n_mb, training


def _check_order(plan: Plan) -> None:
    """Neighbours must agree on the order of what crosses between them (FIFO links)."""
    def seq(rank: int, op: str) -> list[int]:
        return [a.microbatch for a in plan[rank] if a.op == op]

    for s in range(len(plan) - 1):
        for op, left, right in ((F, s, s + 1), (B, s + 1, s)):
            sent, used = seq(left, op), seq(right, op)
            for k, (i, j) in enumerate(zip(sent, used)):
                if i != j:
                    raise PlanError(
                        f"{Action(right, op, j)}: stage {right} runs micro-batch {j} "
                        f"as its #{k} {op} but stage {left} produces {i} there; "
                        "neighbouring stages must agree on order"
                    )


def _waiting_on(a: Action) -> Action:
    return Action(a.stage, RECV_F if a.op == F else RECV_B, a.microbatch)


def _execute(plan: Plan, fwd_cost, bwd_cost, comm: float) -> dict[int, list]:
    """List-schedule the compute actions; sends never block, receives wait.

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
                if a.op == F:
                    dep = (r - 1, F, a.microbatch) if r > 0 else None
                else:
                    dep = (r + 1, B, a.microbatch) if r < last else None
                if dep is not None and dep not in done:
                    break
                ready = done[dep] + comm if dep is not None else 0.0
                start = max(clock[r], ready)
                end = start + (fwd_cost(r) if a.op == F else bwd_cost(r))
                done[(r, a.op, a.microbatch)] = end
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
    _execute(plan, lambda r: 1.0, lambda r: 1.0, 0.0)
    return with_comms(plan)


def simulate(plan: Plan, forward, backward=None, comm: float = 0.0) -> Simulation:
    """Cost a plan: when each action runs, the makespan, and the bubble.

    Args:
        plan: a valid plan (compute-only or with comms).
        forward: per-micro-batch forward cost, one float for all stages or a list per stage.
        backward: same for backward; defaults to the forward costs.
        comm: delay between a stage finishing and its neighbour being able to start.

    Returns:
        Simulation with makespan, per-rank timeline (action, start, end), busy
        time, idle time and bubble fraction = idle / (ranks × makespan).
    """
    plan = compute_only(validate(plan))
    backward = forward if backward is None else backward

    def per_stage(c):
        return (lambda r: float(c[r])) if isinstance(c, (list, tuple)) else (lambda r: float(c))

    timeline = _execute(plan, per_stage(forward), per_stage(backward), comm)
    makespan = max((end for tl in timeline.values() for _, _, end in tl), default=0.0)
    busy = {r: sum(e - s for _, s, e in tl) for r, tl in timeline.items()}
    idle = {r: makespan - b for r, b in busy.items()}
    total = makespan * len(plan)
    bubble = sum(idle.values()) / total if total else 0.0
    return Simulation(makespan, timeline, busy, bubble, idle)


def render(plan: Plan, forward: float = 1.0, backward: float = 1.0) -> str:
    """ASCII grid of a plan under integer costs: time across, ranks down."""
    sim = simulate(plan, forward, backward)
    width = max(len(str(a)) for acts in plan.values() for a in acts) + 1
    slots = int(round(sim.makespan))
    lines = ["t      | " + "".join(f"{t:<{width}}" for t in range(slots))]
    for r, tl in sim.timeline.items():
        cells = ["." for _ in range(slots)]
        for a, start, end in tl:
            for t in range(int(round(start)), int(round(end))):
                cells[t] = str(a)
        lines.append(f"rank {r:<2}| " + "".join(f"{c:<{width}}" for c in cells))
    lines.append(f"bubble {sim.bubble_fraction:.3f}  makespan {sim.makespan:g}")
    return "\n".join(line.rstrip() for line in lines)
