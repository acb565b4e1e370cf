"""Pipeline schedules as pure plans.

A plan maps each rank to the ordered list of actions it performs in one training
step. An action names its stage; a rank may hold several stages (`virtual` V per
rank, P·V stages in all), placed by the schedule's placement, stage → rank:

    single  stage s on rank s (V = 1)
    loop    stage s on rank s mod p (interleaved, looped BFS)
    v       stage s on rank s for s < p, on rank 2p-1-s after (ZB-V: the model goes
            down the ranks and back up, so rank 0 holds the first and the last stage)

The placement is also written in the plan itself (`stage_ranks`): every stage's
compute actions sit in its rank's list. Plans are data: they are built, checked
(`validate.validate`), costed (`simulate.simulate`) and drawn (`simulate.render`) without torch
and without processes. The runtime only interprets them.

Every schedule is registered (`registry.SCHEDULES`, by `@register`, with its placement and the V
it runs): the CLI's help texts, the configuration's check and the benchmarks read names
from there, so a new schedule is one decorated function (here, or in `virtual.py` for
several stages per rank) and an entry in `bench/peers.py` if torch has it too.

    GPipe, 2 stages, 3 micro-batches (time across, ranks down):

    rank 0 | 0F0 0F1 0F2  .   .   .  0B0 0B1 0B2
    rank 1 |  .  1F0 1F1 1F2 1B0 1B1 1B2  .   .

Communication is not written by hand: `with_comms` inserts a SEND after every
compute action whose result a neighbour needs and a RECV before every compute
action that needs a neighbour's result.
"""

from __future__ import annotations

from dataclasses import replace

# The plan's vocabulary and the registry live below this module (so `virtual.py` can use them
# without importing this one); their names are re-exported here, where callers have found them.
from brigade.pipeline.plans.action import (  # noqa: F401
    COMM_OPS,
    COMPUTE_OPS,
    LOOP,
    PLACEMENTS,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    SINGLE,
    V_SHAPE,
    Action,
    B,
    Builder,
    F,
    I,
    Op,
    Placement,
    Plan,
    PlanError,
    W,
)
from brigade.pipeline.plans.registry import (  # noqa: F401
    DEFAULT,
    DEFAULT_VIRTUAL,
    SCHEDULES,
    Schedule,
    check,
    expected,
    help_text,
    names,
    place,
    register,
)


def stage_ranks(plan: Plan) -> dict[int, int]:
    """The rank each stage runs on, as the plan places its compute actions."""
    return {a.stage: r for r, acts in plan.items() for a in acts if a.op in COMPUTE_OPS}


def placement(schedule: str, n_ranks: int, virtual: int = 0) -> tuple[int, list[int]]:
    """(V, stage → rank) for `schedule` over `n_ranks` ranks with `virtual` stages each (0: its own).

    The one answer to "which rank runs which stage": pipelines, `brigade check`, the layout and
    `stages_on` all ask it.

    Raises:
        PlanError: an unknown schedule, or a V it cannot run.
    """
    sched = SCHEDULES[check(schedule)]
    v = sched.resolve_virtual(virtual)
    return v, place(sched.placement, n_ranks, v)


def stages_on(schedule: str, n_ranks: int, rank: int, virtual: int = 0) -> list[int]:
    """The stages `rank` holds under `schedule` with `virtual` stages per rank (0: its default)."""
    return [s for s, r in enumerate(placement(schedule, n_ranks, virtual)[1]) if r == rank]


def build(schedule: str, n_ranks: int, n_microbatches: int, virtual: int = 0, costs=None) -> Plan:
    """Build a named schedule's plan over `n_ranks` ranks, `virtual` stages each (0: its default).

    Args:
        costs: what a costed schedule (`auto`) is planned on (`plans.costs.Costs`, per stage; None:
            unit costs); the other schedules' plans do not depend on costs and ignore it.

    Raises:
        PlanError: for an unknown name, sizes below 1, or a V the schedule cannot run.
    """
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    sched = SCHEDULES[schedule]
    v = sched.resolve_virtual(virtual)
    plan = sched.build(n_ranks, n_microbatches, v, costs=costs) if sched.costed else \
        sched.build(n_ranks, n_microbatches, v)
    return whole_first_backward(plan)


def whole_first_backward(plan: Plan) -> Plan:
    """Stage 0's split backwards as whole ones: each I becomes a B, its W goes.

    The first stage has no input gradient to hurry back, so its I does nothing and its W is
    the whole backward, deferred — later than need be, on tensors gone cold (a ResNet-50 stage:
    a deferred W 52 ms against a backward of 47). Run at the I's place instead, it frees the
    micro-batch's activations sooner, and no registered plan ends later in `simulate()` (tested).
    """
    return {r: [replace(a, op=B) if a.stage == 0 and a.op == I else a
                for a in acts if not (a.stage == 0 and a.op == W)] for r, acts in plan.items()}


def _check_sizes(n_stages: int, n_microbatches: int) -> None:
    if n_stages < 1:
        raise PlanError(f"stages={n_stages}: need at least 1 stage")
    if n_microbatches < 1:
        raise PlanError(f"microbatches={n_microbatches}: need at least 1 micro-batch")


@register("gpipe", "all forwards, then all backwards (memory: m activations)")
def gpipe(n_stages: int, n_microbatches: int, n_virtual: int = 1) -> Plan:
    """All forwards, then all backwards (GPipe). Peak memory holds m activations."""
    _check_sizes(n_stages, n_microbatches)
    mbs = range(n_microbatches)
    return {s: [Action(s, F, i) for i in mbs] + [Action(s, B, i) for i in mbs] for s in range(n_stages)}


@register("1f1b", "warm-up, then one forward one backward (memory: p activations)")
def one_f_one_b(n_stages: int, n_microbatches: int, n_virtual: int = 1) -> Plan:
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


def forward_only(n_stages: int, n_microbatches: int, placement: list[int] | None = None) -> Plan:
    """Inference: every stage runs the forwards in order, no backward.

    With a `placement` (stage → rank, from `place`) a rank runs its stages in order, each for
    every micro-batch: inputs always come from an earlier stage, so no rank waits in a cycle.
    """
    _check_sizes(n_stages, n_microbatches)
    placement = placement or list(range(n_stages))
    plan: Plan = {r: [] for r in sorted(set(placement))}
    for s, r in enumerate(placement):
        plan[r] += [Action(s, F, i) for i in range(n_microbatches)]
    return plan


@register("zb", "1F1B with each backward split in I and W, W filling bubbles")
def zero_bubble(n_stages: int, n_microbatches: int, n_virtual: int = 1) -> Plan:
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
    """Insert the sends and receives each compute action implies (a pure pass).

    Only between stages on different ranks: two stages on one rank (the turn of a V)
    hand over by reference, without a message.
    """
    if any(a.op in COMM_OPS for acts in plan.values() for a in acts):
        bad = next(a for acts in plan.values() for a in acts if a.op in COMM_OPS)
        raise PlanError(f"{bad}: with_comms expects a compute-only plan")
    ranks = stage_ranks(plan)
    last = max(ranks, default=0)

    def remote(s: int, other: int) -> bool:
        return 0 <= other <= last and ranks.get(other) != ranks.get(s)

    out: Plan = {}
    for rank, actions in plan.items():
        seq: list[Action] = []
        for a in actions:
            s, i = a.stage, a.microbatch
            if a.op == F:
                seq += [Action(s, RECV_F, i)] if remote(s, s - 1) else []
                seq.append(a)
                seq += [Action(s, SEND_F, i)] if remote(s, s + 1) else []
            elif a.op == W:
                seq.append(a)
            else:
                seq += [Action(s, RECV_B, i)] if remote(s, s + 1) else []
                seq.append(a)
                seq += [Action(s, SEND_B, i)] if remote(s, s - 1) else []
        out[rank] = seq
    return out


def compute_only(plan: Plan) -> Plan:
    """The plan without its sends and receives."""
    return {r: [a for a in acts if a.op in COMPUTE_OPS] for r, acts in plan.items()}

