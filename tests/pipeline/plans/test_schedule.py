"""Plans are data: built, validated, simulated and drawn without torch or processes."""

import itertools

import pytest

from brigade.pipeline.plans.action import SINGLE, Action, B, F, PlanError
from brigade.pipeline.plans.schedule import SCHEDULES, build, forward_only, gpipe, one_f_one_b, with_comms
from brigade.pipeline.plans.simulate import simulate
from brigade.pipeline.plans.validate import validate

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


@pytest.mark.parametrize("args,message", [
    (("zigzag", 2, 2), "unknown schedule 'zigzag'"),
    (("gpipe", 0, 2), "stages=0"),
    (("1f1b", 2, 0), "microbatches=0"),
])
def test_build_rejects_bad_input(args, message):
    with pytest.raises(PlanError, match=message):
        build(*args)


def test_a_schedule_registered_here_is_accepted_everywhere(monkeypatch, capsys):
    """Adding a schedule is one `@register`: config, CLI and bench read the registry."""
    from brigade import config
    from brigade.bench.run import bench_config
    from brigade.cli import build_parser, main
    from brigade.pipeline.plans import registry, schedule

    assert schedule.SCHEDULES is registry.SCHEDULES  # one registry, whoever asks
    monkeypatch.setattr(registry, "SCHEDULES", dict(registry.SCHEDULES))
    monkeypatch.setattr(schedule, "SCHEDULES", registry.SCHEDULES)
    schedule.register("gpipe-again", "GPipe under another name, for this test")(gpipe)

    cfg = config.RunConfig()
    cfg.parallel.schedule = "gpipe-again"
    config.validate(cfg)  # accepted: no error
    cfg.parallel.schedule = "zigzag"
    with pytest.raises(PlanError, match="--schedule 'zigzag': unknown schedule: expected gpipe, 1f1b, zb, "
                                        "interleaved, looped-bfs, zbv, dualpipev, auto or gpipe-again"):
        config.validate(cfg)

    assert main(["schedule", "--schedule", "gpipe-again", "--stages", "2", "--microbatches", "2"]) == 0
    assert "bubble 0.333" in capsys.readouterr().out
    bench = build_parser().parse_args(["bench", "--model", "toy"])
    assert bench_config(bench).schedules == ["gpipe", "1f1b", "zb", "interleaved", "looped-bfs", "zbv",
                                             "dualpipev", "auto", "gpipe-again"]
    with pytest.raises(PlanError, match="--schedules 'fast': unknown schedule"):
        bench_config(build_parser().parse_args(["bench", "--model", "toy", "--schedules", "fast,zb"]))
    assert "gpipe-again: GPipe under another name" in schedule.help_text()
    assert schedule.names()[-1] == "gpipe-again"


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_zero_bubble_holds_one_micro_batch_more_than_1f1b(p):
    """zb's memory cap: stage s starts a forward while it holds at most p - s micro-batches, each
    held until its W, so its peak is min(m, p - s + 1), one more than 1F1B's, at every m."""
    from brigade.pipeline.plans.simulate import peak_held

    for m in range(1, 12):
        assert peak_held(build("zb", p, m)) == {s: min(m, p - s + 1) for s in range(p)}, f"p {p}, m {m}"
    # the plan the cap makes at p 3, m 6, with a backward twice a forward (I and W one each)
    assert simulate(build("zb", 3, 6), 1.0, 2.0).makespan == 21


def test_forward_only_runs_a_ranks_stages_in_order_under_a_placement():
    from brigade.pipeline.plans.schedule import V_SHAPE, place

    assert plan_str(forward_only(4, 2, place(V_SHAPE, 2, 2))) == {0: "0F0 0F1 3F0 3F1", 1: "1F0 1F1 2F0 2F1"}


@pytest.mark.parametrize("args,expected", [
    (("1f1b", 3), (1, [0, 1, 2])),
    (("interleaved", 2), (2, [0, 1, 0, 1])),  # any V: DEFAULT_VIRTUAL when none is asked
    (("interleaved", 2, 3), (3, [0, 1, 0, 1, 0, 1])),
    (("zbv", 3), (2, [0, 1, 2, 2, 1, 0])),
    (("auto", 3, 1), (1, [0, 1, 2])),
])
def test_placement_answers_which_rank_runs_which_stage(args, expected):
    from brigade.pipeline.plans.schedule import placement

    assert placement(*args) == expected


def test_stages_on_lists_a_ranks_stages():
    from brigade.pipeline.plans.schedule import stages_on

    assert stages_on("zbv", 3, 1) == [1, 4]
    assert stages_on("interleaved", 2, 1, 3) == [1, 3, 5]
    assert stages_on("1f1b", 3, 2) == [2]
    assert stages_on("looped-bfs", 2, 0) == [0, 2]


@pytest.mark.parametrize("args,message", [
    (("zigzag", 2), "^--schedule 'zigzag': unknown schedule: expected gpipe, 1f1b, "),
    (("zbv", 2, 3), r"^--virtual 3: schedule zbv runs exactly 2 stage\(s\) per rank$"),
    (("1f1b", 2, 2), r"^--virtual 2: schedule 1f1b runs exactly 1 stage\(s\) per rank; interleaved, "
                     "looped-bfs, zbv and dualpipev hold several$"),
    (("interleaved", 2, -1),
     r"^--virtual -1: schedule interleaved runs any V of 1 or more stage\(s\) per rank$"),
    (("auto", 2, 3), r"^--virtual 3: schedule auto runs 1 to 2 stage\(s\) per rank$"),
])
def test_placement_refuses_an_unknown_schedule_or_a_v_it_cannot_run(args, message):
    from brigade.pipeline.plans.schedule import placement

    with pytest.raises(PlanError, match=message):
        placement(*args)


def test_a_schedule_lists_the_v_it_runs():
    assert SCHEDULES["interleaved"].virtuals(3) == (1, 2, 3)
    assert SCHEDULES["auto"].virtuals(3) == (1, 2)  # most_virtual 2
    assert SCHEDULES["auto"].virtuals(1) == (1,)
    assert SCHEDULES["zbv"].virtuals(3) == (2,)
    assert SCHEDULES["gpipe"].virtuals(3) == (1,)
    assert SCHEDULES["interleaved"].resolve_virtual(0) == 2 and SCHEDULES["zbv"].resolve_virtual(0) == 2
    assert SCHEDULES["auto"].resolve_virtual(2) == 2 and SCHEDULES["gpipe"].resolve_virtual(1) == 1


def test_the_registrys_names_as_messages_and_help_texts_list_them(monkeypatch):
    from brigade.pipeline.plans import registry

    one = {"gpipe": registry.SCHEDULES["gpipe"]}
    monkeypatch.setattr(registry, "SCHEDULES", one)
    assert registry.expected() == "gpipe"
    assert registry.help_text() == "gpipe: all forwards, then all backwards (memory: m activations)"
    one["1f1b"] = SCHEDULES["1f1b"]
    assert registry.expected() == "gpipe or 1f1b"
    assert registry.help_text() == ("gpipe: all forwards, then all backwards (memory: m activations); "
                                    "1f1b: warm-up, then one forward one backward (memory: p activations)")
    assert registry.names() == ["gpipe", "1f1b"]
    assert registry.check("1f1b") == "1f1b"
    with pytest.raises(PlanError, match="^--schedules 'zb': unknown schedule: expected gpipe or 1f1b$"):
        registry.check("zb", "--schedules")


def test_register_records_what_the_schedule_runs(monkeypatch):
    from brigade.pipeline.plans import registry
    from brigade.pipeline.plans.schedule import LOOP, Schedule

    monkeypatch.setattr(registry, "SCHEDULES", {})
    assert registry.register("plain", "one stage per rank")(gpipe) is gpipe
    assert registry.SCHEDULES["plain"] == Schedule("plain", gpipe, "one stage per rank", SINGLE, 1, False,
                                                   None)
    registry.register("looped", "several", placement=LOOP, virtual=None, costed=True, most_virtual=3)(gpipe)
    assert registry.SCHEDULES["looped"] == Schedule("looped", gpipe, "several", LOOP, None, True, 3)
    with pytest.raises(ValueError, match="^placement 'zigzag': expected one of single, loop, v$"):
        registry.register("bad", "a placement no one has", placement="zigzag")
    assert list(registry.SCHEDULES) == ["plain", "looped"]


def test_place_puts_stages_on_ranks_and_refuses_what_no_placement_holds():
    from brigade.pipeline.plans.schedule import LOOP, V_SHAPE, place

    assert place(SINGLE, 3, 1) == place(V_SHAPE, 3, 1) == [0, 1, 2]
    assert place(LOOP, 2, 3) == [0, 1, 0, 1, 0, 1]
    assert place(V_SHAPE, 3, 2) == [0, 1, 2, 2, 1, 0]
    with pytest.raises(PlanError, match=r"^the V placement holds 2 stages per rank \(or 1\), not 3$"):
        place(V_SHAPE, 2, 3)
    with pytest.raises(PlanError, match="^placement 'zigzag': expected one of single, loop, v$"):
        place("zigzag", 2, 1)


def test_build_hands_a_costed_schedule_its_costs_and_no_other(monkeypatch):
    from brigade.pipeline.plans import registry, schedule

    seen = []

    def costed(n_ranks, n_microbatches, n_virtual, costs=None):
        seen.append(costs)
        return gpipe(n_ranks, n_microbatches)

    monkeypatch.setattr(registry, "SCHEDULES", dict(registry.SCHEDULES))
    monkeypatch.setattr(schedule, "SCHEDULES", registry.SCHEDULES)
    registry.register("costed", "planned on its costs", costed=True)(costed)
    registry.register("sized", "planned on sizes only")(lambda p, m, v: gpipe(p, m))
    costs = object()
    assert build("costed", 2, 3, costs=costs) == gpipe(2, 3) and seen == [costs]
    assert build("sized", 2, 3, costs=costs) == gpipe(2, 3)  # a builder without costs= is not given them
    assert build("costed", 2, 3) == gpipe(2, 3) and seen == [costs, None]


def test_build_names_the_schedules_it_knows():
    names = ", ".join(SCHEDULES)
    with pytest.raises(PlanError, match=f"^unknown schedule 'zigzag': expected one of {names}$"):
        build("zigzag", 2, 2)
    assert SCHEDULES["interleaved"].resolve_virtual() == 2  # no V asked: the default


def test_with_comms_refuses_a_plan_that_has_its_communication_already():
    with pytest.raises(PlanError, match="^0SEND_F0: with_comms expects a compute-only plan$"):
        with_comms(with_comms(gpipe(2, 1)))
