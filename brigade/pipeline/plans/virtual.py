"""Schedules with several stages per rank: interleaved 1F1B, looped BFS, ZB-V and DualPipeV,
as pure plans.

`--stages P` ranks each hold V stages, so the model is cut into P·V pieces; the placement
(`schedule.place`) says which rank runs which stage. Every builder here is registered in
`schedule.SCHEDULES` and returns `{rank: [Action(global stage, op, mb)]}`, checked by
`validate.validate` like the one-stage-per-rank schedules.

    interleaved, p=2, V=2, m=4 (loop placement: stages 0, 2 on rank 0; 1, 3 on rank 1),
    unit costs (`simulate.render`):

    rank 0 | 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 .   2B2 .   2B3 0B2 0B3
    rank 1 | .   1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3 .

Every rank walks its stages in one order shared by all ranks (`forward_order`), so the two
ends of every link agree on the order of what crosses it (`validate.validate`), and each plan
runs under NCCL's posting (`nccl.check`). The V schedules (zbv, dualpipev) are written per
rank instead, as phases over a count of each stage's forwards and backwards. No torch import.
"""

from __future__ import annotations

from brigade.pipeline.plans.action import LOOP, V_SHAPE, Action, B, F, I, Plan, PlanError, W
from brigade.pipeline.plans.registry import register

Step = tuple[int, int]  # (local chunk c, micro-batch): chunk c of rank r is stage c·p + r (loop)


def _check(n_ranks: int, n_microbatches: int, n_virtual: int) -> None:
    if n_ranks < 1:
        raise PlanError(f"stages={n_ranks}: need at least 1 rank")
    if n_microbatches < 1:
        raise PlanError(f"microbatches={n_microbatches}: need at least 1 micro-batch")
    if n_virtual < 1:
        raise PlanError(f"virtual={n_virtual}: need at least 1 stage per rank")


def groups(n_ranks: int, n_microbatches: int) -> list[range]:
    """Micro-batches in max(1, m // p) consecutive groups of near-equal size (≥ p when m ≥ p).

    A group of at least p keeps rank 0 busy until the group's first micro-batch comes back
    around from rank p-1 for the next chunk; spreading m mod p over the groups (instead of
    a short last group) is what keeps the bubble at (p-1)/(V·m+p-1) for any m ≥ p.
    """
    n = max(1, n_microbatches // n_ranks)
    base, extra = divmod(n_microbatches, n)
    out, first = [], 0
    for k in range(n):
        size = base + (k < extra)
        out.append(range(first, first + size))
        first += size
    return out


def forward_order(n_ranks: int, n_microbatches: int, n_virtual: int) -> list[Step]:
    """The order of (chunk, micro-batch) forwards, the same on every rank (Megatron-LM's
    table): a group of micro-batches runs through chunk 0, then chunk 1, ..., then the next."""
    return [(c, i) for g in groups(n_ranks, n_microbatches) for c in range(n_virtual) for i in g]


def backward_order(n_ranks: int, n_microbatches: int, n_virtual: int) -> list[Step]:
    """The backwards in the mirror order: each group through the chunks from the last one."""
    last = n_virtual - 1
    return [(last - c, i) for c, i in forward_order(n_ranks, n_microbatches, n_virtual)]


@register("interleaved", "Megatron's interleaved 1F1B, V stages per rank, bubble (p-1)/(V·m+p-1) "
          "(memory: about p(1+1/V) micro-batches of a rank when p divides m, at most 2p-1)",
          placement=LOOP, virtual=None)
def interleaved(n_ranks: int, n_microbatches: int, n_virtual: int = 2) -> Plan:
    """Interleaved 1F1B (Narayanan et al. 2021): warm-up forwards, then one F one B, then drain.

    Rank r warms up with 2(p-1-r) + (V-1)·g forwards (g: the first group's size; p-1-r when
    V = 1, plain 1F1B): under unit costs its first backward is due just then. Works for any
    m ≥ 1; with m < p the one group is shorter than the pipeline and the forwards of a
    chunk wait for the previous chunk to come around.

    Memory: rank r holds up to 2(p-1-r) + (V-1)·g + 1 stage activations (at most V·m). With
    p dividing m, g = p as in Megatron-LM; otherwise g < 2p: the price of keeping the bubble
    at (p-1)/(V·m+p-1) rather than giving a short last group a bubble of its own.
    """
    _check(n_ranks, n_microbatches, n_virtual)
    p, v = n_ranks, n_virtual
    fwd, bwd = forward_order(p, n_microbatches, v), backward_order(p, n_microbatches, v)
    group = len(groups(p, n_microbatches)[0])
    plan: Plan = {}
    for r in range(p):
        warmup = p - 1 - r if v == 1 else 2 * (p - 1 - r) + (v - 1) * group
        warmup = min(warmup, len(fwd))
        acts = [Action(c * p + r, F, i) for c, i in fwd[:warmup]]
        for (cf, f), (cb, b) in zip(fwd[warmup:], bwd):
            acts += [Action(cf * p + r, F, f), Action(cb * p + r, B, b)]
        acts += [Action(c * p + r, B, i) for c, i in bwd[len(fwd) - warmup:]]
        plan[r] = acts
    return plan


@register("looped-bfs", "breadth-first: every micro-batch through a rank's stage before its next "
          "(memory: V·m activations of a stage)", placement=LOOP, virtual=None)
def looped_bfs(n_ranks: int, n_microbatches: int, n_virtual: int = 2) -> Plan:
    """Looped BFS (Lamy-Poirier 2022): GPipe over each of a rank's stages in turn.

    Forwards run chunk by chunk (all micro-batches of chunk 0, then of chunk 1, ...),
    backwards from the last chunk back, each in reverse micro-batch order, so the last
    stage starts its backwards with the micro-batch it just finished.
    """
    _check(n_ranks, n_microbatches, n_virtual)
    p, m, v = n_ranks, n_microbatches, n_virtual
    plan: Plan = {}
    for r in range(p):
        stages = [c * p + r for c in range(v)]
        plan[r] = ([Action(s, F, i) for s in stages for i in range(m)]
                   + [Action(s, B, i) for s in reversed(stages) for i in reversed(range(m))])
    return plan


@register("zbv", "zero-bubble V: 2 stages per rank (down the ranks and back), backward split in "
          "I and W (memory: 2p stage activations, like 1F1B's p)", placement=V_SHAPE, virtual=2)
def zbv(n_ranks: int, n_microbatches: int, n_virtual: int = 2) -> Plan:
    """ZB-V (Qi et al. 2024, section 6): rank r holds stage r (going down) and 2p-1-r (coming
    back up); each backward is split into I (input gradient, sent on) and W (weight gradient).

    Rank r's list, with a = stage r, b = stage 2p-1-r (unit costs F = I = W):

        warm-up   2(p-r)-1 × aF,  r × (bF aF),  p-r × (bF bI bW)
        steady    (aF) aI aW bF bI bW          while forwards are left
        drain     r × (aI bI),  p-r × (aI aW),  then the W's left, b's first

    Built for max(m, 2p-1) micro-batches, the smallest count that fills the V, and cut back
    to m: actions of micro-batches ≥ m are dropped, the order of the rest is kept.
    """
    _check(n_ranks, n_microbatches, n_virtual)
    if n_virtual != 2:
        raise PlanError(f"virtual={n_virtual}: zbv holds exactly 2 stages per rank")
    return {r: [a for a in _zbv_rank(n_ranks, n_microbatches, r) if a.microbatch < n_microbatches]
            for r in range(n_ranks)}


def _zbv_rank(p: int, m: int, r: int) -> list[Action]:
    n = max(2 * p - 1, m)
    a, b = r, 2 * p - 1 - r
    count: dict[tuple[int, str], int] = {}
    acts: list[Action] = []

    def run(*steps: tuple[int, str]) -> None:
        for stage, op in steps:
            k = count.get((stage, op), 0)
            acts.append(Action(stage, op, k))
            count[(stage, op)] = k + 1

    def done(stage: int, op: str) -> int:
        return count.get((stage, op), 0)

    run(*[(a, F)] * (2 * (p - r) - 1))
    run(*[(b, F), (a, F)] * r)
    run(*[(b, F), (b, I), (b, W)] * (p - r))
    while done(b, F) < done(a, F) or done(a, F) < n:
        run(*([(a, F)] if done(a, F) < n else []), (a, I), (a, W), (b, F), (b, I), (b, W))
    run(*[(a, I), (b, I)] * r)
    run(*[(a, I), (a, W)] * (p - r))
    run(*[(b, W)] * (done(b, I) - done(b, W)))
    run(*[(a, W)] * (done(a, I) - done(a, W)))
    return acts


@register("dualpipev", "DualPipe folded into a V: 2 stages per rank, full backwards in the steady "
          "state, split I/W only in the ramps (memory: 2p+1 stage activations, one more than zbv)",
          placement=V_SHAPE, virtual=2)
def dualpipev(n_ranks: int, n_microbatches: int, n_virtual: int = 2) -> Plan:
    """DualPipeV (DeepSeek-V3 report, 2024; torch's ScheduleDualPipeV): ZB-V's placement, but a
    backward is split into I and W only where a W can fill a wait (the warm-up and the drain);
    the steady state pairs a forward of one stage with a full backward (B) of the other, so
    the split's overhead is paid on 2p-1-r of rank r's 2m backwards, whatever m, not all.

    Rank r's list, with a = stage r, b = stage 2p-1-r:

        warm-up   2(p-1-r) × aF,  r+1 × (aF bF),  p-1-r × (bI bW bF)
        steady    m-2p+r+1 × (aF bB bF aB)          (torch overlaps each F with the next B)
        drain     p-1-r × (bB bF aB),  then r+1 × (bB aB) with the last r+1 of these backwards
                  split (I now, W later),  p-1-r × (W aI),  r+1 × W   (W: oldest pending first)

    Any m ≥ 1: torch needs m ≥ 2p; below that a phase whose count is negative is empty, the
    warm-up then names micro-batches ≥ m and those actions are dropped (the order of the rest
    is kept). This idles less than building for 2p and cutting back as zbv does (p = 4, m = 4:
    bubble 0.200 vs 0.273) and is checked over p ≤ 4, m ≤ 9 by the tests. With m ≥ 2p and
    F = I = W = 1, B = 2 the bubble is ZB-V's, (p-1)/(6m+p-1); a rank holds at most 2p+1
    stage activations (ZB-V: 2p): a steady step runs its forward before the backward it overlaps.

    Raises:
        PlanError: sizes below 1, or a V other than 2.
    """
    _check(n_ranks, n_microbatches, n_virtual)
    if n_virtual != 2:
        raise PlanError(f"virtual={n_virtual}: dualpipev holds exactly 2 stages per rank")
    return {r: [x for x in _dualpipev_rank(n_ranks, n_microbatches, r) if x.microbatch < n_microbatches]
            for r in range(n_ranks)}


_OLDEST_W = (-1, W)  # a step meaning "the oldest W still pending on this rank, any stage"


def _dualpipev_rank(p: int, m: int, r: int) -> list[Action]:
    a, b = r, 2 * p - 1 - r
    count: dict[tuple[int, str], int] = {}  # B and I share a counter: one backward per (stage, mb)
    pending: list[Action] = []
    acts: list[Action] = []

    def run(*steps: tuple[int, str]) -> None:
        for stage, op in steps:
            if (stage, op) == _OLDEST_W:
                acts.append(pending.pop(0))
                continue
            key = (stage, F if op == F else B)
            k = count.get(key, 0)
            acts.append(Action(stage, op, k))
            count[key] = k + 1
            if op == I:
                pending.append(Action(stage, W, k))

    run(*[(a, F)] * (2 * (p - 1 - r)))
    run(*[(a, F), (b, F)] * (r + 1))
    run(*[(b, I), _OLDEST_W, (b, F)] * (p - 1 - r))
    run(*[(a, F), (b, B), (b, F), (a, B)] * (m - 2 * p + r + 1))  # m < 2p: maybe negative, none
    run(*[(b, B), (b, F), (a, B)] * (p - 1 - r))
    last = [(b, B), (a, B)] * (r + 1)  # the first r+1 full, the last r+1 split: W's fill the drain
    run(*last[:r + 1], *[(s, I) for s, _ in last[r + 1:]])
    run(*[_OLDEST_W, (a, I)] * (p - 1 - r))
    run(*[_OLDEST_W] * (r + 1))
    return acts
