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


def test_render_draws_a_longer_action_across_its_columns():
    """A backward twice a forward fills two columns: its name, then `~`; the header numbers every
    column and each cell is as wide as the widest action, plus one space."""
    assert render(gpipe(2, 2), 1.0, 2.0) == (
        "t      | 0   1   2   3   4   5   6   7   8\n"
        "rank 0 | 0F0 0F1 .   .   .   0B0 ~   0B1 ~\n"
        "rank 1 | .   1F0 1F1 1B0 ~   1B1 ~   .   .\n"
        "bubble 0.333  makespan 9")


def test_render_leaves_out_what_takes_no_time():
    """Free forwards take no column (the column is the shortest action that takes any time); with
    nothing taking time there is no column at all."""
    assert render(gpipe(1, 2), 0.0, 1.0) == "t      | 0   1\nrank 0 | 0B0 0B1\nbubble 0.000  makespan 2"
    assert render(gpipe(1, 1), 0.0, 0.0) == "t      |\nrank 0 |\nbubble 0.000  makespan 0"


def test_a_transfer_is_paid_between_ranks_only():
    """ZB-V hands stage p-1's output to stage p on the same rank by reference: no link delay there.
    p = 1: both stages on rank 0, the link costs nothing; p = 2: four crossings of 0.5 each."""
    one = build("zbv", 1, 1)
    assert simulate(one, 1.0, 2.0, comm=5.0).makespan == simulate(one, 1.0, 2.0).makespan == 6.0
    two = build("zbv", 2, 1)
    assert simulate(two, 1.0, 2.0).makespan == 10.0
    assert simulate(two, 1.0, 2.0, comm=0.5).makespan == 12.0


def test_execute_asks_the_link_delay_of_the_stage_that_receives():
    from brigade.pipeline.plans.timeline import execute

    timeline = execute(gpipe(3, 1), lambda stage, op: float(stage) if op == "comm" else 1.0)
    assert {r: [(str(a), s, e) for a, s, e in tl] for r, tl in timeline.items()} == {
        0: [("0F0", 0.0, 1.0), ("0B0", 9.0, 10.0)],
        1: [("1F0", 2.0, 3.0), ("1B0", 8.0, 9.0)],  # 1F0: 0F0's end + stage 1's delay (1)
        2: [("2F0", 5.0, 6.0), ("2B0", 6.0, 7.0)],
    }


def test_simulate_defaults_the_backward_to_the_forward_and_free_actions_to_no_bubble():
    assert simulate(gpipe(2, 2), 1.5).makespan == simulate(gpipe(2, 2), 1.5, 1.5).makespan == 9.0
    free = simulate(gpipe(2, 2), 0.0, 0.0)
    assert free.makespan == 0.0 and free.bubble_fraction == 0.0 and free.idle == {0: 0.0, 1: 0.0}


def test_a_plan_with_no_action_sends_nothing_and_takes_no_time():
    """The pure passes take a plan whose ranks have no action (validate accepts it: no micro-batch
    is missing) and give back as little: nothing to send, nothing run, a makespan of 0."""
    from brigade.pipeline.plans.schedule import with_comms
    from brigade.pipeline.plans.timeline import execute

    assert with_comms({0: []}) == {0: []}
    assert execute({0: []}, lambda stage, op: 1.0) == {0: []}
    sim = simulate({0: []}, 1.0)
    assert (sim.makespan, sim.bubble_fraction, sim.idle, sim.peak_held) == (0.0, 0.0, {0: 0.0}, {})


def test_peak_held_counts_down_one_micro_batch_at_each_backward():
    """After 0B0 stage 0 holds nothing; then two forwards: a peak of 2 (not 1, nor 3)."""
    assert peak_held(parse_plan(["0F0 0B0 0F1 0F2 0B1 0B2"])) == {0: 2}
    assert peak_held(build("1f1b", 3, 4)) == {0: 3, 1: 2, 2: 1}
    assert peak_held(gpipe(2, 3)) == {0: 3, 1: 3}


def test_on_cores_counts_all_the_ranks_work_where_they_share_fewer_cores():
    from brigade.pipeline.plans.schedule import build

    sim = simulate(build("1f1b", 4, 4), 1.0, 2.0)  # 12 a rank: 48 in all; makespan 2·(4+3)·1.5 = 21
    assert sim.makespan == 21.0 and sum(sim.busy.values()) == 48.0
    assert sim.on_cores(0) == sim.on_cores(4) == sim.on_cores(6) == 21.0  # a core a rank, or none said
    assert sim.on_cores(2) == 24.0  # 48 ÷ 2: the cores, not the bubble, bound it
    assert sim.on_cores(3) == 21.0  # 48 ÷ 3 = 16 < the makespan
    assert sim.on_cores(1) == 48.0 and sim.on_cores(0.5) == 96.0  # one core, half of one
