import pytest

from brigade.pipeline import ordering
from brigade.pipeline.schedule import SCHEDULES, Action, PlanError, build, forward_only, validate


@pytest.mark.parametrize("name", [*SCHEDULES, "forward"])
def test_grouped_policy_never_deadlocks_under_nccl(name):
    for p in range(1, 6):
        for m in range(1, 10):
            plan = validate(forward_only(p, m) if name == "forward" else build(name, p, m))
            ordering.check(plan, ordering.GROUPED)


def test_old_eager_policy_deadlocks_1f1b_on_two_stages():
    with pytest.raises(PlanError, match=r"NCCL deadlock: rank 0 is stuck at \[0RECV_B0\]"):
        ordering.check(validate(build("1f1b", 2, 4)), ordering.EAGER)


def test_late_payloads_are_unsafe_under_nccl():
    # Why the transport needs shapes predicted under NCCL: a payload sent after its group mis-pairs.
    with pytest.raises(PlanError):
        ordering.simulate_nccl(ordering.issued(validate(build("1f1b", 2, 4)), ordering.GROUPED,
                                               mispredicted=True))


def test_grouped_batches_one_send_with_the_receives_that_follow():
    plan = validate(build("1f1b", 2, 3))
    issues = ordering.posting(plan[1], ordering.GROUPED)
    assert [i.ops for i in issues][:2] == [
        (Action(1, "RECV_F", 0),), (Action(1, "SEND_B", 0), Action(1, "RECV_F", 1))]
    assert issues[0].after == ordering.BEGIN and issues[1].after == 1  # after 1SEND_B0 (comm #1)


def test_every_comm_action_is_issued_once():
    for policy in ordering.POLICIES:
        acts = validate(build("zb", 3, 5))[1]
        ops = [a for i in ordering.posting(acts, policy) for a in i.ops]
        assert sorted(ops) == sorted(a for a in acts if "SEND" in a.op or "RECV" in a.op)


def test_eager_posts_first_receives_at_begin():
    acts = validate(build("gpipe", 3, 2))[1]
    first = [i.ops for i in ordering.posting(acts, ordering.EAGER) if i.after == ordering.BEGIN]
    assert first == [(Action(1, "RECV_F", 0),), (Action(1, "RECV_B", 0),)]


def test_unknown_policy_is_refused():
    with pytest.raises(PlanError, match="posting policy 'fast'"):
        ordering.posting([], "fast")


def test_mispaired_streams_are_reported():
    streams = {0: [((Action(0, "SEND_F", 0), 0),)], 1: [((Action(1, "RECV_F", 1), 0),)]}
    with pytest.raises(PlanError, match="0SEND_F0 should meet 1RECV_F0"):
        ordering.simulate_nccl(streams)
