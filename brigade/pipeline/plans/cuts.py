"""`auto`'s cut: which blocks make each stage, chosen together with the schedule from the same
per-block costs (no torch import).

The solver (`stages.partition.solve`) cuts so that the slowest stage's forward + backward is as
short as it can be. That is not the cut whose plan ends first: under the V placement a rank
holds two stages (s and 2p-1-s), so what must balance is each rank's pair, not each stage; the
first micro-batch reaches a rank's first stage only after the stages above it have run once;
and a split backward (I + W) costs more than a whole one on some stages and less on others. On
the GPT bench at pp 2 (issue #44) auto reached 0.991 of `bounds.lower_bound` on the cut the bench
gave it, but only 0.947 of `bounds.balanced_bound`; over every cut, `results/cut_bound` found one
whose bound is within 0.1 % of the balanced one. So the cut is searched with the plan:

    1. weigh cuts by `bounds.stage_bound` (no plan built: microseconds a cut): every contiguous
       cut of the blocks into p·V stages when there are at most ENUMERATE, as cut_bound does;
       beyond that, descents on the bound from the caller's cuts, an even one and RESTARTS
       drawn ones (a fixed random stream), one block from one stage to another at a time,
       keeping every cut they weighed;
    2. screen cuts by the step `auto`'s plan takes on them (`generate.span`: auto's plan
       without its search for the least memory, a few times cheaper): the caller's cuts first
       (so the choice is never longer in simulation than they are) and the SEEDS lowest
       bounds. No plan on a cut ends before the cut's bound, so a cut whose bound is within
       `close` (0.1 %) of the shortest step yet cannot win by more. Where all cuts were weighed
       and at most `budget` are left below that line, they are all screened, lowest bound
       first, until the next bound crosses it: the choice is then the best over every cut to
       within `close` (`Choice.proven`). Else the budget goes to a descent on the screened
       step from the shortest cut yet (`_climb`): the lowest bounds are often cuts whose
       plans fill and drain badly (a bound counts no bubble but the first forwards), so
       ordering by bound alone spent the budget on them (p 4, V 2, m 8, 32 blocks: 64 plans,
       none shorter than the solver's cut; the descents found one 2 % shorter).
    3. plan the caller's cuts and the FINALS shortest screened with `auto` itself, simulate
       them as the runtime runs them, and keep the shortest.

"Shortest" is what `auto` itself compares its candidate plans by (`handwritten.or_handwritten`):
the makespan with the transfer delay, or where the ranks share fewer cores than they are
(`Costs.cores`) `Simulation.on_cores`. Of equally short cuts the one met first wins: the
caller's, then the one screened first. Everything is a function of the costs (the drawn cuts
come from a fixed stream): every process that searches on the same costs keeps the same cut.

A block's costs are (forward, backward, weight, input) seconds, as `measure.stages.block_costs`
and the planner's interpolation give them; a stage's are its blocks' sums.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from brigade.pipeline.plans.action import V_SHAPE, PlanError
from brigade.pipeline.plans.bounds import rank_bounds, stage_bound
from brigade.pipeline.plans.costs import Costs
from brigade.pipeline.plans.generate import span
from brigade.pipeline.plans.registry import place
from brigade.pipeline.plans.schedule import build
from brigade.pipeline.plans.simulate import simulate

ENUMERATE = 50_000  # cuts weighed one by one (ResNet-50's 18 blocks into 8 stages: 19,448)
RESTARTS = 32  # beyond ENUMERATE, descents from drawn cuts (found the best bound in 17 of 18 tests)
BUDGET = 128  # cuts screened at most, per V (`generate.span`: 10-60 ms each at p 2-4, V 2, m 8-16)
SEEDS = 4  # the lowest bounds screened first, beside the caller's cuts
FINALS = 2  # the shortest screened that auto then plans in full (a caller's cut always is)
CLOSE = 1e-3  # stop once no cut left can be more than this much shorter (relative)
_SAME = 1e-9  # relative: two steps this close are equally short (floating-point sums)

Block = Sequence[float]  # (forward, backward, weight, input) seconds of one block


@dataclass(frozen=True)
class Choice:
    """The cut `choose_cut` kept and what it knows of it.

    balance: blocks per stage (p·V entries). virtual: V. costs: the stages' costs the plan was
    generated on (`plans.costs.Costs`). makespan: `simulate()`'s, with the transfer delay. score:
    what cuts were compared by (the makespan, or `on_cores`). bound: the cut's `lower_bound`.
    given: the best score of the caller's cuts at this V (None: none given). screened: cuts
    screened by `generate.span`. weighed: cuts weighed by their bound. proven: every cut was
    weighed and every one whose bound is below the choice's step by more than `close` was
    screened, so no cut's plan is shorter by more than that (else the descent chose).
    """

    balance: tuple[int, ...]
    virtual: int
    costs: Costs
    makespan: float
    score: float
    bound: float
    given: float | None
    screened: int
    weighed: int
    proven: bool


def cuts(n_blocks: int, n_stages: int) -> Iterator[list[int]]:
    """Every contiguous cut of `n_blocks` blocks into `n_stages` non-empty stages, as block counts
    (fewest blocks early first)."""
    for ends in itertools.combinations(range(1, n_blocks), n_stages - 1):
        bounds = (0, *ends, n_blocks)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def stage_costs(blocks: Sequence[Block], balance: Sequence[int], comm: float = 0.0, limit: int = 0,
                cores: float = 0.0) -> Costs:
    """The stages' costs under `balance`: each its blocks' sums, as `plans.costs.Costs` takes them.

    Raises:
        PlanError: a balance that does not cut these blocks into non-empty stages.
    """
    if sum(balance) != len(blocks) or min(balance, default=0) < 1:
        raise PlanError(f"cut {list(balance)}: expected non-empty stages adding up to the "
                        f"{len(blocks)} blocks the costs are for")
    ends = list(itertools.accumulate(balance, initial=0))
    per = [tuple(math.fsum(b[j] for b in blocks[a:e]) for a, e in zip(ends, ends[1:])) for j in range(4)]
    return Costs(per[0], per[3], per[2], backward=per[1], comm=comm, limit=limit, cores=cores)


class _Weigher:
    """A cut's `lower_bound` from prefix sums of the blocks' costs, no plan built; where the ranks
    share fewer `cores` than they are, also all their work over the cores (`on_cores` is never
    less: each micro-batch runs F and a B, or I + W, on every stage)."""

    def __init__(self, blocks: Sequence[Block], where: list[int], m: int, cores: float = 0.0):
        self.sums = [list(itertools.accumulate((b[j] for b in blocks), initial=0.0)) for j in range(4)]
        self.where, self.m = where, m
        self.cores = cores if 0 < cores < len(set(where)) else 0.0

    def __call__(self, balance: Sequence[int]) -> float:
        return self.key(balance)[0]

    def key(self, balance: Sequence[int]) -> tuple[float, tuple[float, ...]]:
        """(the bound, every rank's own bound, largest first): what the descent lowers, the
        largest first, then the next (so it crosses the bound's plateaus)."""
        ends = list(itertools.accumulate(balance, initial=0))
        f, b, w, i = ([s[e] - s[a] for a, e in zip(ends, ends[1:])] for s in self.sums)
        grad = [min(x, y) for x, y in zip(b, i)]
        whole = [min(x, y + z) for x, y, z in zip(b, i, w)]
        bound = stage_bound(self.where, self.m, f, grad, whole)
        if self.cores:
            bound = max(bound, self.m * (sum(f) + sum(whole)) / self.cores)
        return bound, tuple(sorted(rank_bounds(self.where, self.m, f, whole).values(), reverse=True))


def _even(blocks: Sequence[Block], n_stages: int) -> tuple[int, ...]:
    """The cut nearest to equal forward + backward per stage, a seed for the descent."""
    sums = list(itertools.accumulate((b[0] + b[1] for b in blocks), initial=0.0))
    n, ends = len(blocks), [0]
    for k in range(1, n_stages):
        want = sums[-1] * k / n_stages
        at = min(range(1, n), key=lambda e: abs(sums[e] - want))
        ends.append(max(ends[-1] + 1, min(at, n - (n_stages - k))))
    ends.append(n)
    return tuple(b - a for a, b in zip(ends, ends[1:]))


def _descend(weigh: _Weigher, start: tuple[int, ...], found: dict[tuple[int, ...], tuple]) -> None:
    """From `start`, take the move (`_moves`) that lowers the ranks' bounds most (`_Weigher.key`)
    while one does; every cut weighed goes into `found`."""
    cut = start
    if cut not in found:
        found[cut] = weigh.key(cut)
    while True:
        step = None
        for moved in _moves(cut):
            if moved not in found:
                found[moved] = weigh.key(moved)
            if _lower(found[moved], found[cut]) and (step is None or _lower(found[moved], found[step])):
                step = moved
        if step is None:
            return
        cut = step


def _lower(a: tuple, b: tuple) -> bool:
    """Whether key `a` is lower than key `b` by more than rounding: the bound first, then each
    rank's own bound, largest first."""
    for x, y in zip((a[0], *a[1]), (b[0], *b[1])):
        if x < y * (1 - _SAME):
            return True
        if x > y * (1 + _SAME):
            return False
    return False


def _weighed(weigh: _Weigher, n_blocks: int, n_stages: int,
             seeds: list[tuple[int, ...]]) -> tuple[list[tuple[float, tuple[int, ...]]], bool]:
    """(every cut weighed, lowest bound first; whether that is every cut there is)."""
    if math.comb(n_blocks - 1, n_stages - 1) <= ENUMERATE:
        return sorted((weigh(c), tuple(c)) for c in cuts(n_blocks, n_stages)), True
    found: dict[tuple[int, ...], tuple] = {}
    draw = random.Random(0)  # the same cuts on every process and every run
    for seed in [*seeds, *(_drawn(draw, n_blocks, n_stages) for _ in range(RESTARTS))]:
        _descend(weigh, seed, found)
    return sorted((key[0], cut) for cut, key in found.items()), False


def _drawn(draw: random.Random, n_blocks: int, n_stages: int) -> tuple[int, ...]:
    """A cut drawn at random: where the descent starts again, to leave a local minimum."""
    ends = (0, *sorted(draw.sample(range(1, n_blocks), n_stages - 1)), n_blocks)
    return tuple(b - a for a, b in zip(ends, ends[1:]))


def choose_cut(blocks: Sequence[Block], ranks: int, microbatches: int, virtuals: Sequence[int] = (2,),
               given: Sequence[Sequence[int]] = (), comm: float = 0.0, limit: int = 0, cores: float = 0.0,
               budget: int = BUDGET, close: float = CLOSE) -> Choice:
    """The cut of `blocks` into `ranks` × V stages, and the V among `virtuals`, whose `auto` plan
    simulates shortest (module docstring).

    Args:
        blocks: per block, its (forward, backward, weight, input) costs, in any one unit.
        given: cuts to weigh first (the solver's, the user's); those of another stage count are
            left to the V they fit.
        comm, limit, cores: the transfer delay, the activations a rank may hold (0: any) and the
            cores the ranks share (0: a device each), as `plans.costs.Costs` takes them.
        budget: the most cuts screened per V. close: how much shorter (relative) a cut not
            screened may at most be once the search stops on the bound.

    Raises:
        PlanError: no V of `virtuals` fits the blocks, a given cut does not cut them, or auto
            cannot run these sizes.
    """
    best = None
    for v in virtuals:
        if ranks * v > len(blocks):
            continue
        got = _at_virtual(blocks, ranks, microbatches, v, given, (comm, limit, cores), (budget, close))
        if best is None or got.score < best.score * (1 - _SAME):
            best = got
    if best is None:
        raise PlanError(f"{len(blocks)} blocks cannot make {ranks} ranks × V stages for V in "
                        f"{list(virtuals)}: use fewer ranks or a smaller V")
    return best


class _Screen:
    """Cuts screened by `generate.span` (auto's step without its memory search), each once."""

    def __init__(self, blocks: Sequence[Block], p: int, m: int, v: int, priced: tuple[float, int, float]):
        self.blocks, self.sizes, self.priced = blocks, (p, m, v), priced
        self.scores: dict[tuple[int, ...], float] = {}

    def __call__(self, cut: tuple[int, ...]) -> float:
        if cut not in self.scores:
            self.scores[cut] = span(*self.sizes, stage_costs(self.blocks, cut, *self.priced))
        return self.scores[cut]

    def best(self) -> tuple[float, tuple[int, ...]]:
        """(score, cut) of the shortest screened yet; the first screened of equally short ones."""
        top = min(self.scores.values())
        return top, next(c for c, s in self.scores.items() if s <= top * (1 + _SAME))


def _at_virtual(blocks: Sequence[Block], p: int, m: int, v: int, given: Sequence[Sequence[int]],
                priced: tuple[float, int, float], stop: tuple[int, float]) -> Choice:
    """`choose_cut` at one V. `priced`: (comm, limit, cores); `stop`: (budget, close).

    The caller's cuts and the SEEDS lowest bounds are screened first. If few cuts are left whose
    bound is below the shortest step yet, all of them are, lowest bound first, until the next
    bound shows that none left can win (`proven`); else the budget goes to a descent on the
    screened step from the shortest cut yet (`_climb`). The caller's cuts and the FINALS
    shortest screened are then planned by `auto` itself and simulated: the shortest wins.
    """
    (budget, close), n = stop, p * v
    weigh = _Weigher(blocks, place(V_SHAPE, p, v), m, priced[2])
    mine = list(dict.fromkeys(tuple(g) for g in given if len(g) == n))
    for cut in mine:
        stage_costs(blocks, cut)  # a given cut that does not cut these blocks: one line, here
    ranked, every = _weighed(weigh, len(blocks), n, [*mine, _even(blocks, n)])
    screen = _Screen(blocks, p, m, v, priced)
    for cut in [*mine, *(c for _, c in ranked[:SEEDS])]:
        screen(cut)
    below = [c for b, c in ranked if b < screen.best()[0] * (1 - close) and c not in screen.scores]
    proven = every and len(below) <= budget - len(screen.scores)
    if proven:
        for cut in below:  # lowest bound first
            if weigh(cut) >= screen.best()[0] * (1 - close):
                break
            screen(cut)
    else:
        _climb(screen, weigh, budget, close)
    finals = [*mine, *[c for c in sorted(screen.scores, key=screen.scores.get) if c not in mine][:FINALS]]
    found = (weigh, proven, len(ranked), len(screen.scores))
    return _planned(blocks, (p, m, v), priced, finals, len(mine), found)


def _climb(screen: _Screen, weigh: _Weigher, budget: int, close: float) -> None:
    """Descents on the screened step until `budget` cuts are screened: from the shortest cut not
    yet descended from, screen its neighbours (`_moves`) lowest bound first, leaving those whose
    bound shows they cannot beat the shortest yet, and go on to the shortest neighbour while it
    is shorter; then start again from the next shortest."""
    started: set[tuple[int, ...]] = set()
    while len(screen.scores) < budget:
        here = next((c for c in sorted(screen.scores, key=screen.scores.get) if c not in started), None)
        while here is not None and len(screen.scores) < budget:
            started.add(here)
            line = screen.best()[0] * (1 - close)
            for bound, cut in sorted((weigh(c), c) for c in _moves(here) if c not in screen.scores):
                if bound >= line or len(screen.scores) >= budget:
                    break
                screen(cut)
            there = min((c for c in _moves(here) if c in screen.scores), key=screen.scores.get, default=None)
            here = there if there and screen.scores[there] < screen.scores[here] * (1 - _SAME) else None
        if here is None and all(c in started for c in screen.scores):
            return


def _moves(cut: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Every cut one block away: one stage gives a block to another, the stages between shift by
    one. Any two stages, not only neighbours: under the V placement the stages a rank holds are
    far apart in the model."""
    for a, b in itertools.permutations(range(len(cut)), 2):
        if cut[a] > 1:
            moved = list(cut)
            moved[a], moved[b] = moved[a] - 1, moved[b] + 1
            yield tuple(moved)


def _planned(blocks: Sequence[Block], sizes: tuple[int, int, int], priced: tuple[float, int, float],
             finals: list[tuple[int, ...]], n_given: int, found: tuple) -> Choice:
    """`auto`'s own plan on each of `finals` (the first `n_given` the caller's), simulated as the
    runtime will run it; the `Choice` of the shortest, the first of equally short ones."""
    (p, m, v), (comm, limit, cores), (weigh, proven, weighed, screened) = sizes, priced, found
    best, given = None, None
    for k, cut in enumerate(finals):
        costs = stage_costs(blocks, cut, comm, limit, cores)
        sim = simulate(build("auto", p, m, v, costs), list(costs.forward), list(costs.backward), comm=comm,
                       weight=list(costs.weight), input_grad=list(costs.input_grad))
        score = sim.on_cores(cores)
        if k < n_given:
            given = score if given is None else min(given, score)
        if best is None or score < best[0] * (1 - _SAME):
            best = (score, cut, costs, sim.makespan)
    score, cut, costs, makespan = best
    return Choice(cut, v, costs, makespan, score, weigh(cut), given, screened, weighed, proven)
