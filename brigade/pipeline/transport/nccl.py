"""A proof, by simulating NCCL, that the posting of `ordering` never deadlocks.

NCCL executes a communicator's point-to-point operations in the order they
are issued, on one stream per rank; a send and its receive complete only when
both have reached the head of their streams (ops issued together by one
`batch_isend_irecv` form a group and run concurrently). So the *issue order*,
not the plan alone, decides whether a step deadlocks. Gloo has no such
constraint: its receives can wait ahead of time without blocking sends.

`check(plan, policy, mode)` lays out every rank's batches of `ordering.posting`
as NCCL runs them (`issued`) and runs them (`simulate_nccl`); NCCL pairs sends
and receives by order per pair of ranks, whichever stages they link (`_pair`).

Under "grouped" a step is "predicted" (payloads only, sizes from the previous
step) or "discovery" (headers first), the same on every rank (the first stage
broadcasts it, `ordering.mode_for`). Discovery cannot send a batch's headers,
then its payloads:

    GPipe, 1 mb  rank 0 [0SEND_F0' 0RECV_B0'] [0SEND_F0 0RECV_B0]   0RECV_B0' needs
                 rank 1 [1RECV_F0'] [1RECV_F0] [1SEND_B0'] ...      0SEND_F0: deadlock

so `discovery_batches` cuts each batch by the round its ops complete in the
predicted run (ops of one round never wait for one another). Each part is up to
three exchanges, as `P2PTransport._issue_discovery` issues them (sends, then
receives, in each group):

    GPipe, 3 stages, rank 1, a part of round 2
    [meta headers  1SEND_F0' 1RECV_F2'] ─host reads─►
    [descriptions  1SEND_F0" 1RECV_F2"] ─host reads─►   structures only (`message`)
    [payloads      1SEND_F0  1RECV_F2 ]

A structure's description is sent by its sender, which knows its layout, and
received by its receiver once the meta header said a description follows: so
both ends of a message agree, message by message, and a part whose messages are
all plain tensors has no description group. `issued(plan, policy, mode,
structures)` lays out both modes (`structures`: every message a structure, none,
or the sends whose messages are) and `simulate_nccl` runs them, issuing a
receive's description only once its header arrived and its payload only once its
description (or, plain, its header) arrived. A real rank issues a group later than
modelled only while all its earlier groups are done, so the modelled run stays
possible. (A structure without tensors sends no payload: a matched pair fewer,
which can only remove waits.)

No torch import: this module is pure, like `schedule` and `ordering`.
"""

from __future__ import annotations

from collections.abc import Collection

from brigade.pipeline.plans.action import RECV_B, RECV_F, SEND_B, SEND_F, Action, Plan, PlanError
from brigade.pipeline.plans.schedule import stage_ranks
from brigade.pipeline.transport.ordering import DISCOVERY, GROUPED, MODES, PREDICTED, Issue, peer_of, posting

PAYLOAD, HEADER, DESCRIPTION = 0, 1, 2  # the part of a message an `Op` carries
Op = tuple[Action, int]  # (comm action, PAYLOAD, HEADER or DESCRIPTION)
READ_ORDER = (HEADER, DESCRIPTION, PAYLOAD)  # a receive's parts, each issued once the earlier arrived
Structures = bool | Collection[Action]  # every message a structure, none, or these sends' messages


def issued(plan: Plan, policy: str, mode: str = PREDICTED,
           structures: Structures = False) -> dict[int, list[tuple[Op, ...]]]:
    """Each rank's issued groups in stream order, for a plan with comms.

    In "predicted" mode each batch of `posting` is one group of payloads. In
    "discovery" mode each batch is cut into `rounds` (see `discovery_batches`) and
    each part is its meta headers, then the descriptions of its structures (no group
    when it has none), then its payloads, each group sends first as P2P issues them
    (`simulate_nccl` issues a receive's next part only once the earlier ones completed:
    the host reads them first).

    Args:
        plan: every rank's actions with comms. policy: "grouped" or "eager".
        mode: "predicted" or "discovery".
        structures: which messages are structures (discovery sends their descriptions):
            True (all), False (none) or the send actions whose messages are.

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
            if mode == PREDICTED:
                groups.append(tuple((a, PAYLOAD) for a in issue.ops))
                continue
            for ops in _cut(issue.ops, done):
                groups += _discovery_part(ops, structures)
        streams[r] = groups
    return streams


def _discovery_part(ops: tuple[Action, ...], structures: Structures) -> list[tuple[Op, ...]]:
    """[headers] [descriptions of structures] [payloads], sends first (`_issue_discovery`)."""
    ops = tuple(a for a in ops if a.op in (SEND_F, SEND_B)) + tuple(
        a for a in ops if a.op not in (SEND_F, SEND_B))
    described = tuple((a, DESCRIPTION) for a in ops if _is_structure(a, structures))
    return [g for g in (tuple((a, HEADER) for a in ops), described,
                        tuple((a, PAYLOAD) for a in ops)) if g]


def _is_structure(a: Action, structures: Structures) -> bool:
    if isinstance(structures, bool):
        return structures
    return _send_of(a) in structures


def _send_of(a: Action) -> Action:
    """The send of the message that comm action `a` sends or receives."""
    if a.op in (SEND_F, SEND_B):
        return a
    return Action(peer_of(a), SEND_F if a.op == RECV_F else SEND_B, a.microbatch)


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
    """0SEND_F1' is 0SEND_F1's meta header, 0SEND_F1" its description, 0SEND_F1 its payload."""
    return f"{op[0]}" + {HEADER: "'", DESCRIPTION: '"'}.get(op[1], "")


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

    Each rank's host issues its groups in order; a group holding the description or
    payload of a receive is issued only once that receive's earlier parts (`READ_ORDER`)
    in the streams completed (the host reads the header to size the description, and
    the header or description to size the payload).
    Each rank executes its issued groups in order; an op completes with its partner
    when both sit in the groups at the head of their ranks' streams; a group leaves
    the head once all its ops completed. (Issuing a group later than this, after
    computing, changes nothing: groups behind the head cannot run anyway.)

    Raises:
        PlanError: "NCCL deadlock: ..." naming each stuck group and what it waits for.
    """
    partner = _pair(streams, ranks if ranks is not None else _identity(streams))
    where = {op: r for r, groups in streams.items() for g in groups for op in g}
    def stuck(head, done) -> str:
        return "NCCL deadlock: " + "; ".join(_stuck(streams, head, done, partner, where))

    return run_streams(streams, {op: (op, partner[op]) for op in where},
                       lambda group, done: _unread(group, where, done), stuck)


def run_streams(streams: dict, meeting: dict, unread, stuck) -> dict:
    """The rounds of a run of `streams` (each a stream's groups, in order), as NCCL runs them: an op
    completes, with every op of its `meeting` (a send and its receive; a collective's every
    member), once all of them sit in the groups at the heads of their streams and their hosts
    could issue those groups (`unread(group, done)`: the earlier parts of its receives not yet
    arrived, which the host must read first); a group leaves the head once all its ops completed.
    Returns the round each op completed in.

    Raises:
        PlanError: `stuck(head, done)`, where no op can complete.
    """
    where = {op: key for key, groups in streams.items() for g in groups for op in g}
    head = {key: 0 for key in streams}
    done: dict = {}

    def at_head(op) -> bool:
        key = where[op]
        return head[key] < len(streams[key]) and op in streams[key][head[key]] and \
            not unread(streams[key][head[key]], done)

    now = 0
    while any(head[k] < len(g) for k, g in streams.items()):
        progressed = False
        for key, groups in streams.items():
            for op in groups[head[key]] if head[key] < len(groups) else ():
                if op not in done and all(o in where and at_head(o) for o in meeting[op]):
                    done.update((o, now) for o in meeting[op])
                    progressed = True
        for key, groups in streams.items():
            while head[key] < len(groups) and all(op in done for op in groups[head[key]]):
                head[key] += 1
                progressed = True
        if not progressed:
            raise PlanError(stuck(head, done))
        now += 1
    return done


def _identity(streams) -> dict[int, int]:
    """One stage per rank: stage s on rank s (and one past the last, which no op names)."""
    return {s: s for s in range(len(streams) + 1)}


def _unread(group, where, done) -> list[Op]:
    """The earlier parts (header, description), not yet arrived, of the receives in `group`."""
    return [(a, q) for a, part in group if a.op in (RECV_F, RECV_B)
            for q in READ_ORDER[:READ_ORDER.index(part)] if (a, q) in where and (a, q) not in done]


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


def check(plan: Plan, policy: str, mode: str = PREDICTED, structures: Structures = False) -> None:
    """Prove that `plan` (with comms) runs without deadlock under NCCL with `policy` in `mode`.

    Args:
        structures: which messages are structures (`issued`): discovery sends their descriptions.

    Raises:
        PlanError: on a deadlock or on sends and receives that do not pair up.
    """
    simulate_nccl(issued(plan, policy, mode, structures), stage_ranks(plan))
