"""The NCCL proof (`nccl`) over a world of pipeline replicas whose stages meet in collectives.

Under expert parallel (`parallel.experts`) the stages of an expert group's replicas, one
pipeline line each, meet in all-to-alls inside their computations: every F, B and I of a stage
holding a mixture of experts (an I carries the all-to-all's backward; a W only weight
gradients). An all-to-all completes only once every process of the group has reached it, so the
lines are no longer independent: one line's point-to-point order can now hold up another's.

`simulate(lines, policy, meets, group)` lays out every process's host order, the
groups of `nccl.issued` (the line's mode's) with a collective placed where the process computes:

    rank 1 of line g:  [1RECV_F0] ─ 1F0: all-to-all with line g' ─ [1SEND_F0 1RECV_B0] ─ 1B0: ...

and runs them all as one stream per process: an op completes when every op it meets (its
send's receive, or the same collective on each line of its group) is at the head of its
stream. One stream is stricter than NCCL, which runs each communicator on a stream of its own
and orders them only where one waits for another's tensors (a subset of host order): a
world this proves free of deadlock cannot deadlock under NCCL.

What it shows (tests/pipeline/transport/test_collectives.py): every registered schedule, with
every stage meeting, runs to the end, in either mode, and with the lines of a group in different
modes (one discovering sizes while another predicts them: no line waits on another's sizes).
It needs one thing: every line runs the same plan, so that the lines reach their collectives in
one order. Lines that run different plans (a costed schedule planned on each line's own
timings, say) deadlock, or worse, pair all-to-alls of different sizes; so where lines meet, the
pipeline's plan is proven the same on every process of the world before it runs
(`parallel.experts.same_plan`).

No torch import: pure, like `nccl`.
"""

from __future__ import annotations

from collections.abc import Collection

from brigade.pipeline.plans.action import COMM_OPS, RECV_B, RECV_F, B, F, I, Plan
from brigade.pipeline.plans.schedule import stage_ranks
from brigade.pipeline.transport import nccl
from brigade.pipeline.transport.ordering import DISCOVERY, PREDICTED, posting

MEET = 3  # the part of an `Op` that is a collective
MEETING_OPS = (F, B, I)  # the computations an all-to-all runs in (module docstring)


def host_order(plan: Plan, rank: int, policy: str, mode: str, meets: Collection[int],
               rounds: dict | None = None) -> list[tuple[nccl.Op, ...]]:
    """`rank`'s groups in the order its host issues them: `nccl.issued`'s batches, each once the
    comm action it follows is handled (`Issue.after`), and a collective group `((action, MEET),)`
    at each F, B or I of a stage in `meets`. `rounds`: the predicted run's (discovery cuts by
    them; computed when None)."""
    if mode == DISCOVERY and rounds is None:
        rounds = nccl.rounds(plan, policy)
    issues: dict[int, list] = {}
    for issue in posting(plan, rank, policy):
        if mode == PREDICTED:
            parts = [tuple((a, nccl.PAYLOAD) for a in issue.ops)]
        else:
            parts = [g for ops in nccl._cut(issue.ops, rounds) for g in nccl._discovery_part(ops, False)]
        issues.setdefault(issue.after, []).extend(parts)
    out = list(issues.get(-1, []))
    handled = -1
    for a in plan.get(rank, []):
        if a.op in MEETING_OPS and a.stage in meets:
            out.append(((a, MEET),))
        elif a.op in COMM_OPS:
            handled += 1
            out.extend(issues.get(handled, []))
    return out


def simulate(lines: list[tuple[Plan, str]], policy: str, meets: Collection[int], group: int) -> int:
    """Run a world of pipeline lines, line g running `lines[g]` (its plan with comms, and its
    mode), whose stages in `meets` meet in a collective over `group` consecutive lines (the
    expert group) at each F, B and I. Returns the rounds it took.

    Raises:
        PlanError: "deadlock: ..." naming each process stuck and what its head waits for.
    """
    streams, meeting = {}, {}
    for g, (plan, mode) in enumerate(lines):
        rounds = nccl.rounds(plan, policy) if mode == DISCOVERY else None
        order = {r: host_order(plan, r, policy, mode, meets, rounds) for r in sorted(plan)}
        for r, groups in order.items():
            streams[(g, r)] = [tuple((g, *op) for op in grp) for grp in groups]
        p2p = {r: [grp for grp in groups if grp[0][1] != MEET] for r, groups in order.items()}
        for op, other in nccl._pair(p2p, stage_ranks(plan)).items():
            meeting[(g, *op)] = ((g, *op), (g, *other))
        first = g - g % group
        for groups in order.values():
            for (a, _), in (grp for grp in groups if grp[0][1] == MEET):
                meeting[(g, a, MEET)] = tuple((h, a, MEET) for h in range(first, first + group))
    return _run(streams, meeting)


def _run(streams: dict, meeting: dict) -> int:
    """The rounds `nccl.run_streams` takes for these streams, each op with all of its meeting
    (the module docstring's rules)."""
    where = {op: key for key, groups in streams.items() for grp in groups for op in grp}
    def stuck(head, done) -> str:
        return "deadlock: " + "; ".join(_stuck(streams, head, done, meeting, where))

    done = nccl.run_streams(streams, meeting, lambda group, done: _unread(group, where, done), stuck)
    return 1 + max(done.values(), default=-1)


def _unread(group, where, done) -> list:
    """The earlier parts, not yet arrived, of the receives in `group` (as `nccl._unread`)."""
    return [(g, a, q) for g, a, part in group if part != MEET and a.op in (RECV_F, RECV_B)
            for q in nccl.READ_ORDER[:nccl.READ_ORDER.index(part)]
            if (g, a, q) in where and (g, a, q) not in done]


def _name(op) -> str:
    g, a, part = op
    return f"line {g} " + (f"{a} all-to-all" if part == MEET else nccl._name((a, part)))


def _stuck(streams, head, done, meeting, where) -> list[str]:
    lines = []
    for (g, r), groups in streams.items():
        pending = [op for op in groups[head[(g, r)]] if op not in done] if head[(g, r)] < len(groups) else []
        if pending:
            op = pending[0]
            away = [o for o in meeting[op] if o != op]
            lines.append(f"line {g} rank {r} waits at {_name(op)} for "
                         + ", ".join(f"{_name(o)} (rank {where[o][1]} of line {where[o][0]})" for o in away))
    return lines


def check(plan: Plan, policy: str, meets: Collection[int], group: int = 2, mode: str = PREDICTED) -> None:
    """Prove that `group` lines of `plan` (with comms), all in `mode`, whose stages in `meets`
    meet in collectives, run to the end under NCCL's rules.

    Raises:
        PlanError: a deadlock (`simulate`).
    """
    simulate([(plan, mode)] * group, policy, meets, group)

