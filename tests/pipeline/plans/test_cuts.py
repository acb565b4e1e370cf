"""`cuts.choose_cut`: auto's cut chosen with its plan, from per-block (forward, backward, weight,
input) costs. Never longer than the cut it is given, within 2 % of the balanced bound where a cut
allows it, the best over every cut where it says it proved so, and its plans valid."""

import dataclasses
import itertools
import math
import random

import pytest

from brigade.pipeline.plans import cuts
from brigade.pipeline.plans.action import PlanError
from brigade.pipeline.plans.bounds import lower_bound
from brigade.pipeline.plans.cuts import choose_cut, stage_costs
from brigade.pipeline.plans.generate import auto, span
from brigade.pipeline.plans.schedule import build, place
from brigade.pipeline.plans.simulate import simulate
from brigade.pipeline.plans.validate import validate

# A ramp: each block dearer than the one before (ResNet-50's later blocks, a model's head).
RAMP = [(0.5 + 0.1 * k, 1.0 + 0.2 * k, 0.5 + 0.1 * k, 0.5 + 0.1 * k) for k in range(12)]
# An embedding that costs nearly nothing, ten equal blocks, and a head twice as dear.
HEAD = [(0.05, 0.05, 0.03, 0.03)] + [(1.0, 2.0, 1.0, 1.0)] * 10 + [(2.0, 4.0, 2.0, 2.0)]


def _step(blocks, cut, p, m, v, cores=0.0):
    """auto's plan on `cut`, simulated on the stages' costs, as the runtime would run it."""
    c = stage_costs(blocks, cut, cores=cores)
    plan = build("auto", p, m, v, c)
    return simulate(plan, list(c.forward), list(c.backward), weight=list(c.weight),
                    input_grad=list(c.input_grad)).on_cores(cores)


def _balanced(blocks, p, m):
    """`balanced_bound` with every block a stage: each block's cheaper backward, over p ranks."""
    return m * sum(f + min(b, w + i) for f, b, w, i in blocks) / p


def _random_blocks(rng, n):
    out = []
    for _ in range(n):
        f = rng.uniform(0.3, 2.0)
        b = f * rng.uniform(1.5, 2.5)
        w = b * rng.uniform(0.35, 0.6)
        out.append((f, b, w, b * rng.uniform(0.45, 0.75)))  # I + W from 0.8 to 1.35 × B
    return out


def test_every_contiguous_cut_is_listed_once():
    listed = list(cuts.cuts(7, 3))
    assert len(listed) == math.comb(6, 2) == len({tuple(c) for c in listed})
    assert all(sum(c) == 7 and min(c) >= 1 for c in listed) and listed[0] == [1, 1, 5]


def test_a_stage_costs_its_blocks_sums_and_a_cut_that_does_not_fit_is_refused():
    c = stage_costs(RAMP[:3], [1, 2], comm=0.5, limit=3, cores=1.0)
    assert c.forward == (0.5, 0.6 + 0.7) and c.backward == (1.0, 1.2 + 1.4)
    assert c.weight == c.input_grad == pytest.approx((0.5, 1.3))
    assert (c.comm, c.limit, c.cores) == (0.5, 3, 1.0)
    for bad in ([1, 1], [3, 0], [2, 2]):
        with pytest.raises(PlanError, match=r"^cut \[.*\]: expected non-empty stages adding up to the 3 "):
            stage_costs(RAMP[:3], bad)


@pytest.mark.parametrize("v", [1, 2])
def test_a_cut_is_weighed_by_the_lower_bound_of_its_plan(v):
    """The search's bound from prefix sums is `lower_bound` on the stages' costs, whatever the cut."""
    rng = random.Random(v)
    blocks = _random_blocks(rng, 8)
    weigh = cuts._Weigher(blocks, place("v", 2, v), 4)
    plan = build("auto", 2, 4, v)
    for cut in cuts.cuts(8, 2 * v):
        c = stage_costs(blocks, cut)
        want = lower_bound(plan, list(c.forward), list(c.backward), weight=list(c.weight),
                           input_grad=list(c.input_grad))
        assert weigh(cut) == pytest.approx(want, rel=1e-12), cut


def test_span_is_the_step_of_autos_own_plan():
    """What the search screens cuts with is what auto's plan takes, without its memory search."""
    rng = random.Random(0)
    for (p, m, v), comm in itertools.product([(2, 4, 1), (2, 8, 2), (3, 6, 2), (4, 8, 1)], (0.0, 0.3)):
        c = dataclasses.replace(stage_costs(_random_blocks(rng, 2 * p * v), [2] * (p * v)), comm=comm)
        plan = auto(p, m, v, c)
        sim = simulate(plan, list(c.forward), list(c.backward), comm=comm, weight=list(c.weight),
                       input_grad=list(c.input_grad))
        assert span(p, m, v, c) == pytest.approx(sim.makespan, rel=1e-9), (p, m, v, comm)


@pytest.mark.parametrize("blocks, p, m, v", [(RAMP, 2, 8, 2), (RAMP, 2, 8, 1), (HEAD, 2, 8, 2),
                                             (HEAD, 4, 16, 2), (RAMP, 3, 6, 2)])
def test_the_chosen_cut_is_never_longer_than_the_given_one(blocks, p, m, v):
    """The even cut (equal forward + backward per stage, the solver's aim) is weighed first: the
    choice's simulated step is at most its step, planned and simulated here apart."""
    even = list(cuts._even(blocks, p * v))
    got = choose_cut(blocks, p, m, (v,), given=[even])
    assert got.given == pytest.approx(_step(blocks, even, p, m, v))
    assert got.score == pytest.approx(_step(blocks, got.balance, p, m, v))
    assert got.score <= got.given * (1 + 1e-12) and got.virtual == v and len(got.balance) == p * v
    assert got.bound <= got.score * (1 + 1e-9)


def test_on_hand_made_unequal_costs_the_chosen_cut_is_shorter():
    """On the ramp at p 2, V 2 the cut balancing each stage ([5, 3, 2, 2]) leaves rank 0 with
    stages 0 and 3 (7 blocks) against rank 1's 5 dearer ones; the chosen cut balances the ranks'
    pairs instead, and its plan ends 3 % sooner."""
    got = choose_cut(RAMP, 2, 8, (2,), given=[[5, 3, 2, 2]])
    assert got.score < 0.97 * got.given and got.balance != (5, 3, 2, 2)


@pytest.mark.parametrize("blocks", [RAMP, HEAD], ids=["ramp", "head"])
def test_where_a_cut_within_two_percent_of_the_balanced_bound_exists_it_is_found(blocks):
    """Brute force first: some cut's auto plan is within 2 % of `balanced_bound` (p 2, V 2, m 8;
    each cut's step as `span` gives it, auto's own, tested above); the search, from the even
    cut (on the ramp, 4.8 % above it), finds one that is, and proves it the best."""
    p, m, v = 2, 8, 2
    balanced = _balanced(blocks, p, m)
    brute = min(span(p, m, v, stage_costs(blocks, c)) for c in cuts.cuts(len(blocks), p * v))
    assert brute <= 1.02 * balanced
    got = choose_cut(blocks, p, m, (v,), given=[list(cuts._even(blocks, p * v))])
    assert got.score <= 1.02 * balanced and got.proven
    assert got.score <= brute * (1 + cuts.CLOSE)
    if blocks is RAMP:
        assert got.given > 1.04 * balanced  # the even cut alone misses the target


@pytest.mark.parametrize("seed", range(3))
def test_a_proven_choice_is_the_best_over_every_cut(seed):
    """Every cut's auto step (brute force, by `span`) against the search's proven choice."""
    rng = random.Random(seed)
    blocks = _random_blocks(rng, 8)
    for p, v, m in [(2, 2, 4), (2, 1, 6), (3, 2, 6)]:
        got = choose_cut(blocks, p, m, (v,))
        brute = min(span(p, m, v, stage_costs(blocks, c)) for c in cuts.cuts(8, p * v))
        assert got.proven and got.weighed == math.comb(7, p * v - 1)
        assert brute * (1 - 1e-9) <= got.score <= brute * (1 + cuts.CLOSE), (p, v, m)


def test_the_best_v_is_chosen_among_those_asked():
    one, two = (choose_cut(RAMP, 2, 16, (v,)) for v in (1, 2))
    both = choose_cut(RAMP, 2, 16, (1, 2))
    assert both.score == min(one.score, two.score) and both.virtual == (1 if one.score < two.score else 2)


def test_on_shared_cores_the_choice_is_weighed_on_them():
    """4 ranks on 2 cores: a step is at least all the work over the cores (`on_cores`)."""
    got = choose_cut(HEAD, 4, 8, (1,), cores=2.0, given=[[3, 3, 3, 3]])
    work = 8 * sum(got.costs.forward[s] + got.costs.backward[s] for s in range(4)) / 2
    assert got.score >= work * (1 - 1e-9) and got.score <= got.given
    assert got.score == pytest.approx(_step(HEAD, got.balance, 4, 8, 1, cores=2.0))


def test_beyond_the_cuts_it_can_list_it_descends_and_never_does_worse(monkeypatch):
    """Past ENUMERATE cuts, descents on the bound and on the screened step replace the list: the
    result is not proven, still no longer than the given cut, and the same on every call (the
    drawn restarts come from a fixed stream)."""
    monkeypatch.setattr(cuts, "ENUMERATE", 10)
    blocks = _random_blocks(random.Random(7), 16)
    even = list(cuts._even(blocks, 4))
    first, again = (choose_cut(blocks, 2, 8, (2,), given=[even], budget=24) for _ in range(2))
    assert not first.proven and first.weighed < math.comb(15, 3)
    assert first.score <= first.given and first.screened <= 24 + cuts.FINALS
    assert first == again


def test_the_chosen_plan_is_valid_for_brigade_and_for_torch():
    """brigade's validator, and torch.distributed.pipelining's own `_validate_schedule` on the
    plan's compute actions (printed alike: `1F3`, `0B2`, `1I0`, `1W0`)."""
    from torch.distributed.pipelining.schedules import _Action, _validate_schedule

    from brigade.pipeline.plans.schedule import compute_only

    for blocks, p, m, v in [(RAMP, 2, 8, 2), (RAMP[:8], 4, 4, 2), (RAMP, 3, 5, 1)]:
        got = choose_cut(blocks, p, m, (v,))
        plan = compute_only(validate(build("auto", p, m, v, got.costs)))
        torch_plan = {r: [_Action.from_str(str(a)) for a in acts] for r, acts in plan.items()}
        assert _validate_schedule(torch_plan, p, p * v, m) == dict(enumerate(place("v", p, v)))


@pytest.mark.parametrize("kwargs, message", [
    (dict(blocks=RAMP[:3], ranks=2, microbatches=4, virtuals=(2,)),
     r"^3 blocks cannot make 2 ranks × V stages for V in \[2\]: use fewer ranks or a smaller V$"),
    (dict(blocks=RAMP, ranks=2, microbatches=4, virtuals=(1,), given=[[6, 5]]),
     r"^cut \[6, 5\]: expected non-empty stages adding up to the 12 blocks"),
])
def test_what_cannot_be_cut_is_refused_in_one_line(kwargs, message):
    with pytest.raises(PlanError, match=message):
        choose_cut(**kwargs)


def test_a_given_cut_of_another_stage_count_is_left_to_the_v_it_fits():
    got = choose_cut(RAMP, 2, 8, (1,), given=[[3, 3, 3, 3], [6, 6]])
    assert got.given == pytest.approx(_step(RAMP, [6, 6], 2, 8, 1))


def test_every_cut_weighed_by_the_descent_is_a_real_cut(monkeypatch):
    monkeypatch.setattr(cuts, "ENUMERATE", 1)
    weigh = cuts._Weigher(RAMP, [0, 1, 1, 0], 8)
    found: dict = {}
    cuts._descend(weigh, (3, 3, 3, 3), found)
    assert all(sum(c) == 12 and min(c) >= 1 and len(c) == 4 for c in found)
    assert min(k[0] for k in found.values()) <= weigh((3, 3, 3, 3))
    assert list(itertools.islice(cuts._moves((1, 2)), 5)) == [(2, 1)]
