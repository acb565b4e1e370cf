"""`auto`: a schedule generated from measured costs, under a memory limit (no torch import).

The hand-written schedules fix an order for unit costs; the zero-bubble paper instead *searches*
an order for the costs the stages really have. This is its heuristic, as a list scheduler: time
runs forward over every rank at once and, whenever a rank is free, it starts

    1. the gradient pass (I, or B on stage 0) of the oldest micro-batch whose gradient has
       arrived: it is on the critical path back to stage 0;
    2. else a forward, if the rank holds fewer micro-batch activations than the limit allows
       (a forward of its chunk c keeps V-1-c places free for that micro-batch's later chunks
       on this rank, so a held micro-batch can always finish: no deadlock by memory);
    3. else a deferred weight pass (W), which frees an activation and fills what would be idle;
    4. else it waits for whichever of 1. or 2. can start first.

A few variants of the rules (which chunk's forward goes first; whether a W may delay a gradient
that arrives during it; a ready forward before a ready gradient) are scheduled with the most
memory allowed and the shortest makespan kept: the makespan is computed exactly as `simulate()`
computes it (start = max(rank free, input arrived + link delay)). The activations a rank may hold
are searched next: the least limit (up to the caller's) at which a variant ends as early as with
the most memory, by bisection (each limit tries first the variants best with the most memory;
more memory never made a plan of this scheduler end later in the tests' grid; where it would,
bisection may keep more). Every stage runs its forwards, gradients and W in micro-batch order,
so gradients accumulate in the same order whatever the costs: two runs planned on different
measurements give the same bits.

Last, the hand-written schedules of the same placement are candidates too (`handwritten`): the
list scheduler is greedy, and on some measured costs DualPipeV's order ends sooner; auto runs
whichever `simulate()` finds shortest, so it is never longer in simulation than a schedule it
could run as. Where the ranks share fewer cores than there are ranks (`Costs.cores`: four CPU
processes on two cores), "shortest" is `Simulation.on_cores`: an idle rank's core goes to another
rank, so a bubble is nearly free while a split backward's extra work (I + W > B) is paid in full,
and a whole-backward schedule (1F1B) may win. Of equally short plans, the one holding fewer
activations wins (auto's own on a full tie).

    p = 2, V = 1, m = 4, unit costs (F = B = 1, I = W = ½), no memory limit, `simulate.render`:

    t      | 0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  16  17
    rank 0 | 0F0 ~   0F1 ~   .   0B0 ~   0F2 ~   0B1 ~   0F3 ~   0B2 ~   .   0B3 ~
    rank 1 | .   .   1F0 ~   1I0 1F1 ~   1I1 1W0 1F2 ~   1I2 1W1 1F3 ~   1I3 1W2 1W3
    bubble 0.111  makespan 9  (zb: the same; 1f1b: 10)

Placement is the V (`registry.place`): V = 1 is one stage per rank; V = 2 goes down the ranks and
back up, as ZB-V and DualPipeV do, so the turn needs no transfer and rank 0, which holds the
first stage's long-lived activations, also holds the last stage's short-lived ones. (The loop
placement at V = 2 needs about m activations per rank to reach the same makespan.)

The costs come from `Costs`: unit costs when a caller has measured nothing (the plan is still a
valid, zero-bubble-shaped one), measured seconds per stage from `brigade bench` and `brigade tune`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import lru_cache

from brigade.pipeline.plans.action import V_SHAPE, Action, B, F, I, Plan, PlanError, W
from brigade.pipeline.plans.costs import Costs
from brigade.pipeline.plans.handwritten import or_handwritten
from brigade.pipeline.plans.registry import place, register
from brigade.pipeline.plans.simulate import simulate


@dataclass(frozen=True)
class Variant:
    """One set of the list scheduler's tie rules; `generate` keeps the variant that ends first.

    deep_first: of two forwards ready at once, the later chunk's (it reaches the loss sooner)
        rather than the earlier chunk's (more warm-up). wait_for_grad: a rank with only a W to
        do waits instead when a gradient arrives before that W would end. forward_first: a
        ready forward goes before a ready input-gradient pass (rule 1 and 2 swapped).
    """

    deep_first: bool
    wait_for_grad: bool
    forward_first: bool = False


VARIANTS = tuple(Variant(d, g, f) for f in (False, True) for d in (True, False) for g in (False, True))


@register("auto", "generated from measured F, I and W costs under a memory limit (zero-bubble "
          "search), 1 or 2 stages per rank (V placement)", placement=V_SHAPE, virtual=None, costed=True,
          most_virtual=2)
def auto(n_ranks: int, n_microbatches: int, n_virtual: int = 1, costs: Costs | None = None) -> Plan:
    """The shortest plan the variants of the list scheduler find for `costs` (unit costs if None),
    with the least activations per rank that keep it shortest.

    Raises:
        PlanError: sizes below 1, a V other than 1 or 2, costs for another number of stages, or a
            memory limit below V (each rank must hold one micro-batch in each of its stages).
    """
    plan = _search(n_ranks, n_microbatches, n_virtual, _relative(costs) if costs else None)
    return {r: list(acts) for r, acts in plan.items()}


def _relative(costs: Costs) -> Costs:
    """`costs` over the largest forward, to 3 decimals: the plan depends on ratios only, and
    costs that differ by a factor (a micro-batch twice the size) share one search in the cache."""
    unit = max((*costs.forward, *costs.input_grad, *costs.weight), default=1.0) or 1.0

    def rel(values):
        return None if values is None else tuple(round(c / unit, 3) for c in values)
    return Costs(rel(costs.forward), rel(costs.input_grad), rel(costs.weight), rel(costs.backward),
                 round(costs.comm / unit, 3), costs.limit, costs.cores)


def span(n_ranks: int, n_microbatches: int, n_virtual: int, costs: Costs) -> float:
    """The step `auto`'s plan takes on `costs`, as `or_handwritten` weighs plans (the makespan,
    or `on_cores` on shared cores), without the search for the least memory that keeps it (which
    never lengthens it on the costs planned on): a few times cheaper than `auto`, so the cut
    search (`cuts.choose_cut`) screens hundreds of cuts with it and plans only the best. It plans
    on `_relative` costs, as `auto` does: the list scheduler is greedy, and rounding the costs
    to 3 decimals changed a plan's step by 2 % in the tests.

    Raises:
        PlanError: as `auto`.
    """
    p, m, v = n_ranks, n_microbatches, n_virtual
    where, planned = _checked(p, m, v, _relative(costs))
    most = min(planned.limit or m * v, m * v)
    runs = (_Greedy(where, m, planned, variant, most).run() for variant in VARIANTS)
    plan = or_handwritten(min(runs, key=lambda run: run[0])[1], p, m, v, planned)
    whole = [costs.whole(s) for s in range(p * v)]
    return simulate(plan, list(costs.forward), whole, comm=costs.comm, weight=list(costs.weight),
                    input_grad=list(costs.input_grad)).on_cores(costs.cores)


def _checked(p: int, m: int, v: int, costs: Costs | None) -> tuple[list[int], Costs]:
    """(each stage's rank, the costs: unit ones if None), once the sizes and costs are checked.

    Raises:
        PlanError: the sizes, the number of costs or the memory limit, in one line.
    """
    if p < 1 or m < 1 or v < 1:
        raise PlanError(f"auto: ranks={p}, microbatches={m}, virtual={v}: each must be at least 1")
    where = place(V_SHAPE, p, v)
    costs = costs or Costs.unit(p * v)
    for name in ("forward", "input_grad", "weight"):
        if len(getattr(costs, name)) != p * v:
            raise PlanError(f"auto: {len(getattr(costs, name))} {name} costs for {p * v} stages "
                            f"(p={p} × V={v}): give one per stage")
    if 0 < costs.limit < v:
        raise PlanError(f"auto: a memory limit of {costs.limit} micro-batch activations per rank is "
                        f"below the {v} stages each rank holds: allow at least {v}")
    return where, costs


def _plan(p: int, m: int, v: int, costs: Costs | None) -> dict[int, tuple[Action, ...]]:
    """`auto`'s plan, its lists as tuples (the cache's values are shared); `_search` caches it."""
    where, costs = _checked(p, m, v, costs)
    most = min(costs.limit or m * v, m * v)
    runs = [_Greedy(where, m, costs, variant, most).run() for variant in VARIANTS]
    top = min(runs, key=lambda run: run[0])  # the first of equal makespans wins
    # the rules that did best with the most memory first: the bisection tries them before others
    order = sorted(VARIANTS, key=lambda var: runs[VARIANTS.index(var)][0])

    def best(limit: int) -> tuple[float, Plan]:
        """The first variant's run that ends as early as `top` under `limit`, else the shortest."""
        if limit == most:
            return top
        tried = []
        for variant in order:
            tried.append(_Greedy(where, m, costs, variant, limit).run())
            if tried[-1][0] <= top[0] * (1 + 1e-9):
                break
        return min(tried, key=lambda run: run[0])

    lo, hi = v, most
    while lo < hi:  # the least limit at which some variant ends as early as with the most memory
        mid = (lo + hi) // 2
        if best(mid)[0] <= top[0] * (1 + 1e-9):
            hi = mid
        else:
            lo = mid + 1
    found = best(lo)
    plan = found[1] if found[0] <= top[0] * (1 + 1e-9) else top[1]
    plan = or_handwritten(plan, p, m, v, costs)
    return {r: tuple(acts) for r, acts in plan.items()}


# The same sizes and costs give the same plan: the tests build many. (Wrapped here rather than
# decorated, so that a mutation run, which leaves decorated functions alone, mutates the search.)
_search = lru_cache(maxsize=256)(_plan)


class _Greedy:
    """One list-scheduling pass (the module docstring's rules) under one `Variant`."""

    def __init__(self, where: list[int], m: int, costs: Costs, variant: Variant, limit: int):
        self.where, self.n, self.p, self.m = where, len(where), max(where) + 1, m
        self.costs, self.variant, self.limit = costs, variant, limit
        self.mine = [[s for s in range(self.n) if where[s] == r] for r in range(self.p)]  # chunk order
        self.f_end: dict[tuple[int, int], float] = {}  # (stage, mb) -> when its F ends
        self.g_end: dict[tuple[int, int], float] = {}  # (stage, mb) -> when its I (or B) ends
        self.next_f, self.next_g = [0] * self.n, [0] * self.n
        self.pending_w: list[deque[int]] = [deque() for _ in range(self.n)]
        self.held, self.clock = [0] * self.p, [0.0] * self.p
        self.plan: Plan = {r: [] for r in range(self.p)}

    def stages(self, rank: int) -> list[int]:
        """The rank's stages, in the order a micro-batch reaches them (chunk 0 first)."""
        return self.mine[rank]

    def arrival(self, stage: int, dep: tuple[int, int], ends: dict) -> float | None:
        """When `dep`'s result is usable on `stage`'s rank, or None while it is not scheduled."""
        if dep not in ends:
            return None
        return ends[dep] + (self.costs.comm if self.where[dep[0]] != self.where[stage] else 0.0)

    def grad_ready(self, s: int) -> float | None:
        k = self.next_g[s]
        if k >= self.next_f[s]:
            return None
        own = self.f_end[s, k]
        if s == self.n - 1:
            return own
        back = self.arrival(s, (s + 1, k), self.g_end)
        return None if back is None else max(own, back)

    def forward_ready(self, s: int, rank: int) -> float | None:
        k, later = self.next_f[s], len(self.mine[rank]) - 1 - self.mine[rank].index(s)
        if k >= self.m or self.held[rank] + later >= self.limit:
            return None
        return 0.0 if s == 0 else self.arrival(s, (s - 1, k), self.f_end)

    def choice(self, rank: int) -> tuple[float, Action] | None:
        """(start, action) this rank would run next, or None while it can start nothing."""
        now = self.clock[rank]
        grads = [(t, -s, Action(s, I, self.next_g[s])) for s in self.stages(rank)
                 if s > 0 and (t := self.grad_ready(s)) is not None]
        order = -1 if self.variant.deep_first else 1
        fwds = [(t, order * s, Action(s, F, self.next_f[s])) for s in self.stages(rank)
                if (t := self.forward_ready(s, rank)) is not None]
        ready_g = min((g for g in grads if g[0] <= now), default=None)
        ready_f = min((f for f in fwds if f[0] <= now), default=None)
        first = (ready_f, ready_g) if self.variant.forward_first else (ready_g, ready_f)
        if first[0] or first[1]:
            return now, (first[0] or first[1])[2]
        deferred = self.deferred(rank, now)
        if deferred:
            soon = min((g[0] for g in grads), default=None)
            if not (self.variant.wait_for_grad and soon is not None and soon < now + self.cost(deferred)):
                return now, deferred
        last = [(t, 0, Action(0, B, self.next_g[0]))] \
            if self.where[0] == rank and (t := self.grad_ready(0)) is not None else []
        later = min(grads + fwds + last, default=None, key=lambda c: (c[0], c in fwds, c[1]))
        return (later[0], later[2]) if later else None

    def deferred(self, rank: int, now: float) -> Action | None:
        """What no other stage waits for, ready now: stage 0's whole backward (it sends nothing
        upstream) before any W, oldest micro-batch first; each frees an activation."""
        if self.where[0] == rank and (t := self.grad_ready(0)) is not None and t <= now:
            return Action(0, B, self.next_g[0])
        return next((Action(s, W, self.pending_w[s][0]) for s in self.stages(rank) if self.pending_w[s]),
                    None)

    def cost(self, a: Action) -> float:
        if a.op == F:
            return self.costs.forward[a.stage]
        if a.op == B:
            return self.costs.whole(a.stage)
        return (self.costs.input_grad if a.op == I else self.costs.weight)[a.stage]

    def commit(self, rank: int, start: float, a: Action) -> None:
        s, k = a.stage, a.microbatch
        end = start + self.cost(a)
        self.clock[rank] = end
        self.plan[rank].append(a)
        if a.op == F:
            self.f_end[s, k], self.next_f[s] = end, k + 1
            self.held[rank] += 1
        elif a.op in (B, I):
            self.g_end[s, k], self.next_g[s] = end, k + 1
            if a.op == B:
                self.held[rank] -= 1
            else:
                self.pending_w[s].append(k)
        else:
            self.pending_w[s].popleft()
            self.held[rank] -= 1

    def run(self) -> tuple[float, Plan]:
        """(makespan, plan): commit the earliest-starting choice of any rank until all is done.

        A rank's choice depends on its own state and on its stages' neighbours: after a commit on
        stage s only the ranks of s - 1, s and s + 1 choose again."""
        total = self.n * self.m * 3 - self.m  # F, I and W per stage; stage 0 a whole B
        choices = {r: self.choice(r) for r in range(self.p)}
        for _ in range(total):
            ready = [(c[0], r, c[1]) for r, c in choices.items() if c]
            if not ready:
                raise PlanError(f"auto: no rank can go on under a limit of {self.limit} "
                                f"activations per rank: allow more")
            start, rank, action = min(ready, key=lambda c: (c[0], c[1]))
            self.commit(rank, max(start, self.clock[rank]), action)
            s = action.stage
            for r in {rank, *(self.where[t] for t in (s - 1, s + 1) if 0 <= t < self.n)}:
                choices[r] = self.choice(r)
        return max(self.clock), self.plan
