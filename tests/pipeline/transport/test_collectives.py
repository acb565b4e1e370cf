"""The NCCL proof over pipeline lines that meet in collectives (brigade/pipeline/transport/collectives.py):
an expert group's all-to-alls inside every F, B and I, beside each line's sends and receives."""

import pytest

from brigade.pipeline.plans.action import Action, PlanError
from brigade.pipeline.plans.schedule import SCHEDULES, build, placement
from brigade.pipeline.plans.validate import validate
from brigade.pipeline.transport import collectives, nccl, ordering


def _plans(name: str):
    """The registered schedule's plans on 2 and 4 ranks, every V it runs, a few micro-batch counts."""
    for p in (2, 4):
        for v in SCHEDULES[name].virtuals(3):
            for m in (1, p, 2 * p + 1):
                try:
                    yield validate(build(name, p, m, v)), len(placement(name, p, v)[1])
                except PlanError:  # a count the schedule cannot run (zbv needs m ≥ p, ...)
                    continue


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_with_an_all_to_all_in_every_stage_never_deadlocks(name):
    """Two lines of one expert group, each stage meeting in every F, B and I: in predicted mode,
    in discovery mode, and with one line discovering while the other predicts."""
    tried = 0
    for plan, stages in _plans(name):
        for modes in ((ordering.PREDICTED,) * 2, (ordering.DISCOVERY,) * 2,
                      (ordering.DISCOVERY, ordering.PREDICTED)):
            collectives.simulate([(plan, m) for m in modes], ordering.GROUPED, range(stages), 2)
            tried += 1
    assert tried >= 6


def test_a_collective_in_some_stages_only_and_four_lines_in_two_groups():
    plan = validate(build("interleaved", 2, 4, 2))
    assert collectives.simulate([(plan, ordering.PREDICTED)] * 4, ordering.GROUPED, {1, 2}, 2) > 0


def test_lines_that_run_different_plans_deadlock_and_the_proof_names_where():
    """What `parallel.experts.same_plan` refuses before a run: line 0 runs 1F1B and line 1 GPipe,
    so their stage 1 reaches its second all-to-all at a B on one line and an F on the other."""
    one, other = validate(build("1f1b", 2, 4)), validate(build("gpipe", 2, 4))
    with pytest.raises(PlanError, match=r"deadlock: .*line 0 rank 1 waits at line 0 1F0 all-to-all|"
                                        r"deadlock: .*all-to-all for line 1"):
        collectives.simulate([(one, ordering.PREDICTED), (other, ordering.PREDICTED)],
                             ordering.GROUPED, range(2), 2)
    collectives.simulate([(one, ordering.PREDICTED)] * 2, ordering.GROUPED, range(2), 2)  # the same: fine


def test_the_host_order_puts_each_collective_between_the_batches_around_its_compute():
    plan = validate(build("1f1b", 2, 2))
    names = [" ".join(nccl._name(op) if op[1] != collectives.MEET else f"{op[0]}*" for op in g)
             for g in collectives.host_order(plan, 1, ordering.GROUPED, ordering.PREDICTED, {1})]
    # both receives posted at the start (one batch), each all-to-all where its compute runs
    assert names == ["1RECV_F0 1RECV_F1", "1F0*", "1B0*", "1SEND_B0", "1F1*", "1B1*", "1SEND_B1"]
    stage0 = collectives.host_order(plan, 0, ordering.GROUPED, ordering.PREDICTED, {1})
    assert all(op[1] != collectives.MEET for g in stage0 for op in g)  # stage 0 does not meet


def test_the_same_plan_in_one_line_is_the_nccl_proof_itself():
    """With no stage meeting, a world of one line is `nccl.check`'s run: the same rounds."""
    plan = validate(build("zb", 3, 5))
    assert collectives.simulate([(plan, ordering.PREDICTED)], ordering.GROUPED, (), 1) == \
        1 + max(nccl.rounds(plan, ordering.GROUPED).values())
    assert Action(0, "F", 0) in plan[0]
