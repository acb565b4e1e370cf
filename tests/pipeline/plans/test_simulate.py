"""`simulate` and `render`: costs per stage and per link, split backwards by their halves, the grid."""

import pytest

from brigade.pipeline.plans.schedule import build, gpipe
from brigade.pipeline.plans.simulate import peak_held, render, simulate
from tests.pipeline.plans.test_validate import parse_plan


def test_simulate_uses_per_stage_costs_and_comm():
    sim = simulate(gpipe(2, 1), [1.0, 3.0], [2.0, 6.0], comm=0.5)
    # 0F0 [0,1] → comm → 1F0 [1.5,4.5] → 1B0 [4.5,10.5] → comm → 0B0 [11,13]
    assert sim.makespan == pytest.approx(13.0)
    assert sim.busy == {0: pytest.approx(3.0), 1: pytest.approx(9.0)}
    assert sim.timeline[0][1][1:] == (pytest.approx(11.0), pytest.approx(13.0))


def test_simulate_costs_a_split_backward_by_its_measured_halves():
    plan = build("zb", 2, 1)  # one micro-batch: 0F0 1F0 1I0, then 0B0 beside 1W0
    rest = simulate(plan, 1.0, 4.0, weight=1.5)  # I = B − W = 2.5
    measured = simulate(plan, 1.0, 4.0, weight=1.5, input_grad=3.0)  # I + W = 4.5 > B
    durations = {str(a): e - s for a, s, e in measured.timeline[1]}
    assert durations["1I0"] == pytest.approx(3.0) and durations["1W0"] == pytest.approx(1.5)
    assert rest.makespan == pytest.approx(1 + 1 + 2.5 + 4)
    assert measured.makespan == pytest.approx(1 + 1 + 3.0 + 4)


def test_render_draws_time_across_ranks_down():
    text = render(gpipe(2, 2))
    assert text.splitlines()[1].split() == ["rank", "0", "|", "0F0", "0F1", ".", ".", "0B0", "0B1"]
    assert text.splitlines()[2].split() == ["rank", "1", "|", ".", "1F0", "1F1", "1B0", "1B1", "."]
    assert "bubble 0.333" in text


def test_peak_held_releases_a_split_micro_batch_at_its_w_not_its_i():
    """A split backward keeps a micro-batch's activations until its weight pass: here stage 0 holds
    both micro-batches between 0I0 and 0W0 (were it released at I, the peak would be 1)."""
    plan = parse_plan(["0F0 0I0 0F1 0W0 0I1 0W1"])
    assert peak_held(plan) == {0: 2}
    assert peak_held(build("zb", 2, 2)) == {0: 2, 1: 2}
