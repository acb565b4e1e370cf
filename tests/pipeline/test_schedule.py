"""Plans are data: built, validated, simulated and drawn without torch or processes."""

import itertools

import pytest

from brigade.pipeline.plan import render, simulate, validate
from brigade.pipeline.schedule import (
    SCHEDULES,
    Action,
    B,
    F,
    PlanError,
    build,
    forward_only,
    gpipe,
    one_f_one_b,
    with_comms,
)

GRID = list(itertools.product(range(1, 6), range(1, 10)))


def plan_str(plan):
    return {r: " ".join(map(str, acts)) for r, acts in plan.items()}


def test_action_prints_and_parses():
    assert str(Action(1, "F", 3)) == "1F3"
    assert str(Action(0, "B", 2)) == "0B2"
    for text in ("1F3", "0B2", "2SEND_F11", "3RECV_B0"):
        assert str(Action.parse(text)) == text
    with pytest.raises(PlanError, match="cannot parse"):
        Action.parse("F3")


def test_gpipe_two_stages_three_microbatches():
    assert plan_str(gpipe(2, 3)) == {0: "0F0 0F1 0F2 0B0 0B1 0B2", 1: "1F0 1F1 1F2 1B0 1B1 1B2"}


def test_1f1b_warms_up_then_alternates():
    assert plan_str(one_f_one_b(3, 4)) == {
        0: "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        1: "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        2: "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    }


def test_1f1b_with_fewer_microbatches_than_stages():
    assert plan_str(one_f_one_b(4, 2))[0] == "0F0 0F1 0B0 0B1"
    validate(one_f_one_b(4, 2))


def test_1f1b_keeps_at_most_depth_in_flight():
    for p, m in GRID:
        for rank, acts in one_f_one_b(p, m).items():
            in_flight = peak = 0
            for a in acts:
                in_flight += 1 if a.op == "F" else -1
                peak = max(peak, in_flight)
            assert peak <= min(p - rank, m)


@pytest.mark.parametrize("p,m", GRID)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_uniform_bubble_matches_formula(schedule, p, m):
    sim = simulate(build(schedule, p, m), 1.0, 1.0)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert sim.makespan == pytest.approx(2 * (m + p - 1))


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


@pytest.mark.parametrize("schedule", ["zb", "zbv", "dualpipev"])
def test_the_first_stage_backward_is_whole_and_never_later(schedule):
    """Stage 0 has no input gradient: its I does nothing and its W is the whole backward.
    Run as one B at the I's place, no plan ends later (costs: F 1, B 2, W 1, stage 0's W 2)."""
    raw = SCHEDULES[schedule].build
    for p, m in itertools.product((2, 3, 4), (1, 2, 3, 4, 8)):
        v = SCHEDULES[schedule].virtual or 1
        plan, before = build(schedule, p, m), raw(p, m, v)
        ops = {a.op for acts in plan.values() for a in acts if a.stage == 0}
        assert ops == {F, B}, (p, m, ops)
        n = p * v
        weight, inputs = [2.0] + [1.0] * (n - 1), [0.0] + [1.0] * (n - 1)
        assert simulate(plan, 1.0, 2.0, weight=weight, input_grad=inputs).makespan <= \
            simulate(before, 1.0, 2.0, weight=weight, input_grad=inputs).makespan + 1e-9, (p, m)


def test_with_comms_pairs_every_send_with_a_receive():
    full = with_comms(one_f_one_b(3, 5))
    for s in range(2):
        sends = [a.microbatch for a in full[s] if a.op == "SEND_F"]
        recvs = [a.microbatch for a in full[s + 1] if a.op == "RECV_F"]
        assert sends == recvs
        sends_b = [a.microbatch for a in full[s + 1] if a.op == "SEND_B"]
        recvs_b = [a.microbatch for a in full[s] if a.op == "RECV_B"]
        assert sends_b == recvs_b
    assert validate(full) == full


def test_forward_only_plan_has_no_backward():
    full = validate(forward_only(3, 2))
    assert plan_str(full) == {0: "0F0 0SEND_F0 0F1 0SEND_F1", 1: "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 "
                              "1SEND_F1", 2: "2RECV_F0 2F0 2RECV_F1 2F1"}


def parse_plan(rows):
    return {r: [Action.parse(t) for t in row.split()] for r, row in enumerate(rows)}


@pytest.mark.parametrize("rows,message", [
    (["0B0 0F0", "1F0 1B0"], "0B0 comes before 0F0"),
    (["0F0 0F1 0B0 0B1", "1F1 1F0 1B0 1B1"], "1F1: stage 1 runs micro-batch 1 as its #0 F"),
    (["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"], "deadlock: ranks wait forever at 0RECV_B0"),
    (["0F0 0F1 0B0", "1F0 1F1 1B0 1B1"], "stage 0 never runs 0B1"),
    (["0F0 0F0 0B0", "1F0 1B0"], "0F0 appears twice on rank 0"),
    (["0F0 0B0", "0F0 1B0"], "0F0 is listed under rank 1"),
    (["0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"], "rank 0: found 0B0 where 0RECV_B0 belongs"),
])
def test_validate_names_the_offending_action(rows, message):
    with pytest.raises(PlanError, match=message):
        validate(parse_plan(rows))


@pytest.mark.parametrize("args,message", [
    (("zigzag", 2, 2), "unknown schedule 'zigzag'"),
    (("gpipe", 0, 2), "stages=0"),
    (("1f1b", 2, 0), "microbatches=0"),
])
def test_build_rejects_bad_input(args, message):
    with pytest.raises(PlanError, match=message):
        build(*args)


def test_render_draws_time_across_ranks_down():
    text = render(gpipe(2, 2))
    assert text.splitlines()[1].split() == ["rank", "0", "|", "0F0", "0F1", ".", ".", "0B0", "0B1"]
    assert text.splitlines()[2].split() == ["rank", "1", "|", ".", "1F0", "1F1", "1B0", "1B1", "."]
    assert "bubble 0.333" in text


def test_a_schedule_registered_here_is_accepted_everywhere(monkeypatch, capsys):
    """Adding a schedule is one `@register`: config, CLI and bench read the registry."""
    from brigade import config
    from brigade.bench.run import bench_config
    from brigade.cli import build_parser, main
    from brigade.pipeline import registry, schedule

    assert schedule.SCHEDULES is registry.SCHEDULES  # one registry, whoever asks
    monkeypatch.setattr(registry, "SCHEDULES", dict(registry.SCHEDULES))
    monkeypatch.setattr(schedule, "SCHEDULES", registry.SCHEDULES)
    schedule.register("gpipe-again", "GPipe under another name, for this test")(gpipe)

    cfg = config.RunConfig()
    cfg.parallel.schedule = "gpipe-again"
    config.validate(cfg)  # accepted: no error
    cfg.parallel.schedule = "zigzag"
    with pytest.raises(PlanError, match="--schedule 'zigzag': unknown schedule: expected gpipe, 1f1b, zb, "
                                        "interleaved, looped-bfs, zbv, dualpipev or gpipe-again"):
        config.validate(cfg)

    assert main(["schedule", "--schedule", "gpipe-again", "--stages", "2", "--microbatches", "2"]) == 0
    assert "bubble 0.333" in capsys.readouterr().out
    bench = build_parser().parse_args(["bench", "--model", "toy"])
    assert bench_config(bench).schedules == ["gpipe", "1f1b", "zb", "interleaved", "looped-bfs", "zbv",
                                             "dualpipev", "gpipe-again"]
    with pytest.raises(PlanError, match="--schedules 'fast': unknown schedule"):
        bench_config(build_parser().parse_args(["bench", "--model", "toy", "--schedules", "fast,zb"]))
    assert "gpipe-again: GPipe under another name" in schedule.help_text()
    assert schedule.names()[-1] == "gpipe-again"


def test_no_plan_beats_the_lower_bound():
    """lower_bound() holds for every schedule, p, V and m on random costs (split backwards
    dearer or cheaper than whole ones), and is reached where nothing can overlap."""
    import random

    from brigade.pipeline.plan import lower_bound

    rng = random.Random(0)
    for name in SCHEDULES:
        for p in (1, 2, 3, 4):
            for m in (1, 2, 3, 5, 8):
                try:
                    plan = build(name, p, m)
                except PlanError:
                    continue  # a V or an m the schedule refuses
                n = len({a.stage for acts in plan.values() for a in acts})
                for _ in range(3):
                    f = [rng.uniform(0.5, 2) for _ in range(n)]
                    b = [rng.uniform(1, 4) for _ in range(n)]
                    w = [rng.uniform(0.1, 0.9) * x for x in b]
                    i = [x - y + rng.uniform(-0.2, 0.3) for x, y in zip(b, w)]
                    got = simulate(plan, f, b, weight=w, input_grad=i).makespan
                    assert lower_bound(plan, f, b, weight=w, input_grad=i) <= got + 1e-9, (name, p, m)
                    got = simulate(plan, f, b, weight=w).makespan  # I = B - W
                    assert lower_bound(plan, f, b, weight=w) <= got + 1e-9, (name, p, m)
                    assert lower_bound(plan, f, b) <= simulate(plan, f, b).makespan + 1e-9
    one = build("gpipe", 1, 4)
    assert lower_bound(one, 1.0, 2.0) == simulate(one, 1.0, 2.0).makespan == 12.0
    # 1F1B, p = 2, m = 4, F = B = 1: rank 1 starts after one F, then has 8 of work (the plan: 10)
    assert lower_bound(build("1f1b", 2, 4), 1.0, 1.0) == 9.0
    # a split backward cheaper than the whole one bounds with I + W
    assert lower_bound(one, 1.0, 2.0, weight=0.5, input_grad=1.0) == 4 * (1.0 + 1.5)
