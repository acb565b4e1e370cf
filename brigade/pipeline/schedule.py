"""Pipeline schedules as pure plans.

A plan maps each rank (one pipeline stage per rank) to the ordered list of
actions it performs in one training step. Plans are data: they are built,
checked (`plan.validate`), costed (`plan.simulate`) and drawn (`plan.render`)
without torch and without processes. The runtime only interprets them.

Every schedule is registered here (`SCHEDULES`, by `@register`): the CLI's help texts, the
configuration's check and the benchmarks read its names from there, so a new schedule is one
decorated function in this file (and an entry in `bench/peers.py` if torch has it too).

    GPipe, 2 stages, 3 micro-batches (time across, ranks down):

    rank 0 | 0F0 0F1 0F2  .   .   .  0B0 0B1 0B2
    rank 1 |  .  1F0 1F1 1F2 1B0 1B1 1B2  .   .

Communication is not written by hand: `with_comms` inserts a SEND after every
compute action whose result a neighbour needs and a RECV before every compute
action that needs a neighbour's result.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from brigade.errors import BrigadeError

F, B = "F", "B"
I, W = "I", "W"  # noqa: E741 -- B split in two: input gradient (sent upstream), weight gradient
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE_OPS = (F, B, I, W)
COMM_OPS = (SEND_F, RECV_F, SEND_B, RECV_B)

Plan = dict[int, list["Action"]]
Builder = Callable[[int, int], Plan]  # (n_stages, n_microbatches) -> plan

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


@dataclass(frozen=True)
class Schedule:
    """A registered schedule: its name on the command line, its builder, one line for help texts."""

    name: str
    build: Builder
    description: str


SCHEDULES: dict[str, Schedule] = {}
DEFAULT = "1f1b"


def register(name: str, description: str) -> Callable[[Builder], Builder]:
    """Decorator: make a builder `(n_stages, n_microbatches) -> Plan` available as `name`."""
    def add(builder: Builder) -> Builder:
        SCHEDULES[name] = Schedule(name, builder, description)
        return builder
    return add


def names() -> list[str]:
    """The registered schedules' names, in registration order."""
    return list(SCHEDULES)


def expected() -> str:
    """``"gpipe, 1f1b or zb"``: the names as an error message lists them."""
    *rest, last = names()
    return f"{', '.join(rest)} or {last}" if rest else last


def help_text() -> str:
    """One line per schedule for a flag's help: ``gpipe: all forwards, then all backwards; ...``."""
    return "; ".join(f"{s.name}: {s.description}" for s in SCHEDULES.values())


def check(name: str, flag: str = "--schedule") -> str:
    """Return `name` if it is a registered schedule.

    Raises:
        PlanError: naming the flag, the value and the registered names.
    """
    if name not in SCHEDULES:
        raise PlanError(f"{flag} {name!r}: unknown schedule: expected {expected()}")
    return name


def build(schedule: str, n_stages: int, n_microbatches: int) -> Plan:
    """Build a named schedule's plan.

    Raises:
        PlanError: for an unknown name or sizes below 1.
    """
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    return SCHEDULES[schedule].build(n_stages, n_microbatches)


def _check_sizes(n_stages: int, n_microbatches: int) -> None:
    if n_stages < 1:
        raise PlanError(f"stages={n_stages}: need at least 1 stage")
    if n_microbatches < 1:
        raise PlanError(f"microbatches={n_microbatches}: need at least 1 micro-batch")


@register("gpipe", "all forwards, then all backwards (memory: m activations)")
def gpipe(n_stages: int, n_microbatches: int) -> Plan:
    """All forwards, then all backwards (GPipe). Peak memory holds m activations."""
    _check_sizes(n_stages, n_microbatches)
    mbs = range(n_microbatches)
    return {s: [Action(s, F, i) for i in mbs] + [Action(s, B, i) for i in mbs] for s in range(n_stages)}


@register("1f1b", "warm-up, then one forward one backward (memory: p activations)")
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


@register("zb", "1F1B with each backward split in I and W, W filling bubbles")
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
    """The plan without its sends and receives."""
    return {r: [a for a in acts if a.op in COMPUTE_OPS] for r, acts in plan.items()}
