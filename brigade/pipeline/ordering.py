"""When a stage issues its point-to-point operations, and a proof that NCCL runs them.

NCCL executes a communicator's point-to-point operations in the order they
are issued, on one stream per rank; a send and its receive complete only when
both have reached the head of their streams (ops issued together by one
`batch_isend_irecv` form a group and run concurrently). So the *issue order*,
not the plan alone, decides whether a step deadlocks. Gloo has no such
constraint: its receives can wait ahead of time without blocking sends.

`posting(actions, policy)` is the one place that decides, for one rank's action
list (with comms, from `schedule.validate`), which operations are issued, in
which batches and after which of the rank's comm actions. `P2PTransport`
issues exactly these batches; `check(plan, policy)` simulates them as NCCL
runs them. The NCCL policy is therefore checked, not assumed.

    1F1B, 2 stages, steady state       old eager policy (deadlocks)
    rank 0 | [0SEND_F1 0RECV_B0]        rank 0 | [0RECV_B0] [0SEND_F0] ...
    rank 1 | [1SEND_B0 1RECV_F1]        rank 1 | [1RECV_F0] [1RECV_F1] ...
             one group each side,         each head waits for a send that is
             all four ops match           queued behind the other's receive

Under "grouped" a step is "predicted" (payloads only, sizes from the previous
step) or "discovery" (headers first), the same on every rank (the first stage
broadcasts it). Discovery cannot send a batch's headers, then its payloads:

    GPipe, 1 mb  rank 0 [0SEND_F0' 0RECV_B0'] [0SEND_F0 0RECV_B0]   0RECV_B0' needs
                 rank 1 [1RECV_F0'] [1RECV_F0] [1SEND_B0'] ...      0SEND_F0: deadlock

so `discovery_batches` cuts each batch by the round its ops complete in the
predicted run (ops of one round never wait for one another) and each part goes
[headers] ─host reads them─► [payloads]. `issued(plan, policy, mode)` lays out
both modes and `simulate_nccl` runs them, issuing a receive's payload only once
its header arrived. A real rank issues a group later than modelled only while
all its earlier groups are done, so the modelled run stays possible.

No torch import: this module is pure, like `schedule`.
"""

from __future__ import annotations

from dataclasses import dataclass

from brigade.pipeline.schedule import (
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
    stage_ranks,
)

GROUPED, EAGER = "grouped", "eager"
POLICIES = (GROUPED, EAGER)  # grouped: safe under NCCL; eager: pre-posted receives (gloo)
PREDICTED, DISCOVERY = "predicted", "discovery"
MODES = (PREDICTED, DISCOVERY)  # how a grouped step learns its receive sizes
STATIC, DYNAMIC = "static", "dynamic"
SHAPES = (STATIC, DYNAMIC)  # dynamic: shapes depend on values, discover every step
BEGIN = -1  # `Issue.after` for operations issued at the start of the step
PAYLOAD, HEADER = 0, 1  # the part of a message an `Op` carries
POLICY_ENV = "BRIGADE_P2P_POLICY"  # forces a policy, e.g. grouped on gloo in tests


def policy_for(backend: str, requested: str | None = None) -> str:
    """The posting policy for a backend: the one place that chooses per backend.

    Args:
        backend: the process group's backend ("nccl", "gloo", ...).
        requested: a policy asked for explicitly (argument or `BRIGADE_P2P_POLICY`); empty
            or None picks the backend's default: grouped for NCCL, eager elsewhere.

    Returns:
        "grouped" or "eager".

    Raises:
        PlanError: an unknown policy, or eager under NCCL (it deadlocks there).
    """
    if not requested:
        return GROUPED if backend == "nccl" else EAGER
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
        plan: every rank's actions with comms inserted (`plan.validate`): the grouped
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
    from brigade.pipeline.plan import simulate  # plan imports nothing of this module

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


Op = tuple[Action, int]  # (comm action, PAYLOAD or HEADER)


def issued(plan: Plan, policy: str, mode: str = PREDICTED) -> dict[int, list[tuple[Op, ...]]]:
    """Each rank's issued groups in stream order, for a plan with comms.

    In "predicted" mode each batch of `posting` is one group of payloads. In
    "discovery" mode each batch is cut into `rounds` (see `discovery_batches`) and
    each part is two groups: its headers, then its payloads (`simulate_nccl` issues
    a receive's payload only once its header completed: the host reads it first).

    Raises:
        PlanError: an unknown policy or mode.
    """
    if mode not in MODES:
        raise PlanError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
    done = rounds(plan, policy) if mode == DISCOVERY else {}
    streams: dict[int, list[tuple[Op, ...]]] = {}
    for r in plan:
        groups: list[tuple[Op, ...]] = []
        for issue in posting(plan, r, policy):
            for ops in _cut(issue.ops, done) if mode == DISCOVERY else [issue.ops]:
                if mode == DISCOVERY:
                    groups.append(tuple((a, HEADER) for a in ops))
                groups.append(tuple((a, PAYLOAD) for a in ops))
        streams[r] = groups
    return streams


def rounds(plan: Plan, policy: str) -> dict[Action, int]:
    """The round in which each comm action completes when `plan` runs in predicted mode.

    Raises:
        PlanError: the plan deadlocks under `policy`.
    """
    return {a: k for (a, _), k in simulate_nccl(issued(plan, policy), stage_ranks(plan)).items()}


def discovery_batches(plan: Plan, rank: int, policy: str = GROUPED) -> list[Issue]:
    """`rank`'s batches in discovery mode: `posting`'s, each cut by completion round.

    A batch's receives may need its own send (see the module docstring); ops of one
    round of the predicted run do not. Needs the whole plan: rounds depend on every rank.
    """
    done = rounds(plan, policy)
    return [Issue(issue.after, ops) for issue in posting(plan, rank, policy) for ops in _cut(issue.ops, done)]


def _cut(ops: tuple[Action, ...], done: dict[Action, int]) -> list[tuple[Action, ...]]:
    by_round: dict[int, list[Action]] = {}
    for a in ops:
        by_round.setdefault(done[a], []).append(a)
    return [tuple(by_round[k]) for k in sorted(by_round)]


def _name(op: Op) -> str:
    return f"{op[0]}" + ("'" if op[1] == HEADER else "")  # 0SEND_F1' is 0SEND_F1's header


def _pair(streams: dict[int, list[tuple[Op, ...]]], ranks: dict[int, int]) -> dict[Op, Op]:
    """Match the k-th send from rank a to b with the k-th receive at b from a (NCCL pairs by
    order per pair of ranks, whichever stages of theirs the messages link)."""
    queues: dict[tuple[int, int, bool], list[Op]] = {}
    for r, groups in streams.items():
        for g in groups:
            for op in g:
                send = op[0].op in (SEND_F, SEND_B)
                peer = ranks[peer_of(op[0])]
                src, dst = (r, peer) if send else (peer, r)
                queues.setdefault((src, dst, send), []).append(op)
    partner: dict[Op, Op] = {}
    for (src, dst, send), ops in queues.items():
        if not send:
            continue
        recvs = queues.get((src, dst, False), [])
        for k, (s, part) in enumerate(ops):
            r = recvs[k] if k < len(recvs) else None
            want = (Action(peer_of(s), RECV_F if s.op == SEND_F else RECV_B, s.microbatch), part)
            if r != want:
                found = f"its #{k} receive there is {_name(r)}" if r else "no receive is issued there"
                raise PlanError(f"{_name((s, part))} should meet {_name(want)} on rank {dst} but {found}")
            partner[(s, part)], partner[r] = r, (s, part)
    unmatched = [op for g in streams.values() for ops in g for op in ops if op not in partner]
    if unmatched:
        raise PlanError(f"{_name(unmatched[0])} is never matched by rank "
                        f"{ranks[peer_of(unmatched[0][0])]}")
    return partner


def simulate_nccl(streams: dict[int, list[tuple[Op, ...]]],
                  ranks: dict[int, int] | None = None) -> dict[Op, int]:
    """Run issued groups as NCCL does; return the round in which each op completed.

    Each rank's host issues its groups in order; a group holding the payload of a
    receive whose header this rank also receives is issued only once that header
    completed (the host reads it to size the payload).
    Each rank executes its issued groups in order; an op completes with its partner
    when both sit in the groups at the head of their ranks' streams; a group leaves
    the head once all its ops completed. (Issuing a group later than this, after
    computing, changes nothing: groups behind the head cannot run anyway.)

    Raises:
        PlanError: "NCCL deadlock: ..." naming each stuck group and what it waits for.
    """
    partner = _pair(streams, ranks if ranks is not None else _identity(streams))
    where = {op: r for r, groups in streams.items() for g in groups for op in g}
    head = {r: 0 for r in streams}
    done: dict[Op, int] = {}
    now = 0

    def issued_yet(r: int) -> bool:  # may the host issue rank r's head group?
        return not _unread(streams[r][head[r]], where, done)

    def at_head(op: Op) -> bool:
        r = where[op]
        return head[r] < len(streams[r]) and op in streams[r][head[r]] and issued_yet(r)

    while any(head[r] < len(g) for r, g in streams.items()):
        progressed = False
        for r, groups in streams.items():
            for op in groups[head[r]] if head[r] < len(groups) else ():
                if op not in done and at_head(op) and at_head(partner[op]):
                    done[op] = done[partner[op]] = now
                    progressed = True
        for r, groups in streams.items():
            while head[r] < len(groups) and all(op in done for op in groups[head[r]]):
                head[r] += 1
                progressed = True
        if not progressed:
            raise PlanError("NCCL deadlock: " + "; ".join(_stuck(streams, head, done, partner, where)))
        now += 1
    return done


def _identity(streams) -> dict[int, int]:
    """One stage per rank: stage s on rank s (and one past the last, which no op names)."""
    return {s: s for s in range(len(streams) + 1)}


def _unread(group, where, done) -> list[Op]:
    """The headers, not yet arrived, of receives whose payloads are in `group`."""
    return [(a, HEADER) for a, part in group if part == PAYLOAD and a.op in (RECV_F, RECV_B)
            and (a, HEADER) in where and (a, HEADER) not in done]


def _stuck(streams, head, done, partner, where) -> list[str]:
    def group(r: int) -> str:
        return " ".join(map(_name, streams[r][head[r]])) if head[r] < len(streams[r]) else "end"

    lines = []
    for r, groups in streams.items():
        pending = [op for op in groups[head[r]] if op not in done] if head[r] < len(groups) else []
        headers = _unread(pending, where, done)
        if headers:
            lines.append(f"rank {r} cannot issue [{group(r)}] before {_name(headers[0])} completes")
        elif pending:
            op = pending[0]
            q = where[partner[op]]
            lines.append(f"rank {r} is stuck at [{group(r)}]: {_name(op)} waits for "
                         f"{_name(partner[op])}, queued behind [{group(q)}] on rank {q}")
    return lines


def check(plan: Plan, policy: str, mode: str = PREDICTED) -> None:
    """Prove that `plan` (with comms) runs without deadlock under NCCL with `policy` in `mode`.

    Raises:
        PlanError: on a deadlock or on sends and receives that do not pair up.
    """
    simulate_nccl(issued(plan, policy, mode), stage_ranks(plan))
