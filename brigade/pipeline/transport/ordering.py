"""When a stage issues its point-to-point operations: the posting policy.

Under NCCL the *issue order*, not the plan alone, decides whether a step
deadlocks (a send and its receive complete only when both reach the head of
their ranks' streams: the rules, and the proof, are in `nccl`). Gloo has no such
constraint: its receives can wait ahead of time without blocking sends.

`posting(actions, policy)` is the one place that decides, for one rank's action
list (with comms, from `validate.validate`), which operations are issued, in
which batches and after which of the rank's comm actions. `P2PTransport`
issues exactly these batches; `nccl.check(plan, policy)` simulates them as NCCL
runs them. The NCCL policy is therefore checked, not assumed.

    1F1B, 2 stages, steady state       old eager policy (deadlocks)
    rank 0 | [0SEND_F1 0RECV_B0]        rank 0 | [0RECV_B0] [0SEND_F0] ...
    rank 1 | [1SEND_B0 1RECV_F1]        rank 1 | [1RECV_F0] [1RECV_F1] ...
             one group each side,         each head waits for a send that is
             all four ops match           queued behind the other's receive

Under "grouped" a step is "predicted" (payloads only, sizes from the previous
step) or "discovery" (headers first, in the batches of `nccl.discovery_batches`),
the same on every rank: `mode_for` decides it on the first stage, which
broadcasts it.

No torch import: this module is pure, like `schedule`.
"""

from __future__ import annotations

from dataclasses import dataclass

from brigade.pipeline.plans.action import (
    COMM_OPS,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    Plan,
    PlanError,
    W,
)

GROUPED, EAGER = "grouped", "eager"
POLICIES = (GROUPED, EAGER)  # grouped: the default, safe under NCCL; eager: pre-posted receives (gloo)
PREDICTED, DISCOVERY = "predicted", "discovery"
MODES = (PREDICTED, DISCOVERY)  # how a grouped step learns its receive sizes
STATIC, DYNAMIC = "static", "dynamic"
SHAPES = (STATIC, DYNAMIC)  # dynamic: shapes depend on values, discover every step
BEGIN = -1  # `Issue.after` for operations issued at the start of the step
POLICY_ENV = "BRIGADE_P2P_POLICY"  # forces a policy, e.g. grouped on gloo in tests


def policy_for(backend: str, requested: str | None = None) -> str:
    """The posting policy for a backend: the one place that chooses.

    Grouped is the default on every backend. On gloo, eager's early receives make gloo's
    I/O thread read while the stage computes; on scarce cores that costs more CPU than the
    overlap gains (measured for issue #14: 3-10x the I/O thread's CPU, 5-20 % of a step).

    Args:
        backend: the process group's backend ("nccl", "gloo", ...).
        requested: a policy asked for explicitly (argument or `BRIGADE_P2P_POLICY`); empty
            or None picks the default, grouped.

    Returns:
        "grouped" or "eager".

    Raises:
        PlanError: an unknown policy, or eager under NCCL (it deadlocks there).
    """
    if not requested:
        return GROUPED
    if requested not in POLICIES:
        raise PlanError(f"{POLICY_ENV}={requested!r}: expected one of {', '.join(POLICIES)}, "
                        "or unset for the backend's default")
    if requested == EAGER and backend == "nccl":
        raise PlanError(f"{POLICY_ENV}=eager deadlocks under NCCL (receives posted ahead of "
                        "sends): use grouped, or unset it")
    return requested


def mode_for(previous: object, current: object, shapes: str = STATIC) -> str:
    """The mode of a grouped step, decided by the first stage from its inputs.

    Assumes every message's dtype and shape are a function of the step's plan and its
    micro-batches' input shapes and dtypes: if `current` (that key) equals `previous`,
    every receive is the size it was in the previous step. A model whose shapes depend
    on values breaks this and needs `shapes="dynamic"` (discovery every step).

    Args:
        previous: the previous step's key, None before the first step.
        current: this step's key (plan and input dtypes and shapes).
        shapes: "static" or "dynamic".

    Returns:
        "predicted" or "discovery".

    Raises:
        PlanError: an unknown `shapes`.
    """
    if shapes not in SHAPES:
        raise PlanError(f"shapes={shapes!r}: expected one of {', '.join(SHAPES)} "
                        "(dynamic when a model's shapes depend on values)")
    same = previous is not None and previous == current
    return PREDICTED if same and shapes == STATIC else DISCOVERY


@dataclass(frozen=True)
class Issue:
    """One batch of operations, issued once comm action number `after` has been handled.

    `after` counts this rank's comm actions in plan order (`BEGIN`: at the start
    of the step). A SEND is handled when its tensor is handed over, a RECV when
    its tensor has arrived. Batches with the same `after` are issued in list order.
    """

    after: int
    ops: tuple[Action, ...]


def peer_of(a: Action) -> int:
    """The stage at the other end of comm action `a`."""
    return a.stage + (1 if a.op in (SEND_F, RECV_B) else -1)


def posting(plan: Plan, rank: int, policy: str) -> list[Issue]:
    """The batches `rank` issues for one step of `plan`, in issue order.

    Args:
        plan: every rank's actions with comms inserted (`validate.validate`): the grouped
            policy orders messages by one clock over the whole plan.
        rank: whose batches.
        policy: "grouped" (every rank issues its operations in the order of one global
            clock, at most one send per batch: safe under NCCL, see `_grouped`) or "eager"
            (each receive posted as soon as the previous one on its link arrived:
            fastest on gloo, deadlocks under NCCL).

    Returns:
        Issues sorted by `after`; every comm action of `rank` appears in exactly one.

    Raises:
        PlanError: for an unknown policy.
    """
    if policy == GROUPED:
        return _grouped(plan, rank)
    if policy == EAGER:
        return _eager([a for a in plan.get(rank, []) if a.op in COMM_OPS])
    raise PlanError(f"posting policy {policy!r}: expected one of {', '.join(POLICIES)}")


def message_clock(plan: Plan) -> dict[tuple[int, str, int], float]:
    """When each message is produced in one run of `plan` under unit costs (F 1, B 2):
    (producing stage, "F" | "B", micro-batch) -> the end of the compute that makes it."""
    from brigade.pipeline.plans.simulate import simulate  # plan imports nothing of this module

    clock = {}
    for tl in simulate(plan, 1.0, 2.0).timeline.values():
        for a, _, end in tl:
            if a.op != W:  # a weight pass sends nothing
                clock[(a.stage, F if a.op == F else B, a.microbatch)] = end
    return clock


def _message(a: Action) -> tuple[int, str, int]:
    """(producing stage, "F" | "B", micro-batch) of the message a comm action carries."""
    producer = a.stage if a.op in (SEND_F, SEND_B) else peer_of(a)
    return producer, F if a.op in (SEND_F, RECV_F) else B, a.microbatch


def _grouped(plan: Plan, rank: int) -> list[Issue]:
    # Every rank issues its operations in the order of one clock over all messages (when
    # a run of the plan produces them; ties by producer). Then the earliest unfinished
    # message always sits at the head of both its ranks' streams: its receive has nothing
    # unfinished before it, and its send's compute needed only earlier messages. So no
    # NCCL deadlock, for any schedule and placement. The clock follows each rank's own
    # compute order, so a receive is never queued behind a send its consumer precedes.
    # Batches: one send each (a send never waits for a later compute), with the receives
    # around it in clock order whose consumers come after it.
    clock = message_clock(plan)
    comms = [a for a in plan.get(rank, []) if a.op in COMM_OPS]
    index = {a: k for k, a in enumerate(comms)}
    order = sorted(comms, key=lambda a: (clock[_message(a)], *_message(a)))
    issues: list[Issue] = []
    ops: list[Action] = []
    after = BEGIN
    for a in order:
        k = index[a]
        if a.op in (SEND_F, SEND_B):
            if ops and (any(b.op in (SEND_F, SEND_B) or index[b] <= k for b in ops)):
                issues.append(Issue(after, tuple(ops)))
                ops = []
            after = max(after, k)
        elif k <= after:
            raise PlanError(f"{a} is needed before {comms[after]} but comes after it in the "
                            "plan's clock: the plan is not a valid run (check it with validate)")
        ops.append(a)
    if ops:
        issues.append(Issue(after, tuple(ops)))
    return issues


def _eager(comms: list[Action]) -> list[Issue]:
    # Receives chain per link (this stage, peer stage): the first of each at the start, the
    # next once the previous one on that link arrived.
    def link(a: Action) -> tuple[int, int]:
        return a.stage, peer_of(a)

    issues: list[Issue] = []
    first: dict[tuple[int, int], Action] = {}
    for a in comms:
        if a.op in (RECV_F, RECV_B):
            first.setdefault(link(a), a)
    issues += [Issue(BEGIN, (a,)) for a in first.values()]
    for k, a in enumerate(comms):
        if a.op in (SEND_F, SEND_B):
            issues.append(Issue(k, (a,)))
            continue
        nxt = next((b for b in comms[k + 1:] if b.op == a.op and link(b) == link(a)), None)
        if nxt is not None:
            issues.append(Issue(k, (nxt,)))
    return issues
