"""The posting policy: which operations a rank issues, in which batches, when."""

import pytest

from brigade.pipeline.plans.action import Action, PlanError
from brigade.pipeline.plans.schedule import build
from brigade.pipeline.plans.validate import validate
from brigade.pipeline.transport import ordering


def test_modes_follow_input_shapes():
    key = (("0F0",), ((("float32",), (4, 3)),))
    assert ordering.mode_for(None, key) == ordering.DISCOVERY  # first step
    assert ordering.mode_for(key, key) == ordering.PREDICTED
    assert ordering.mode_for(key, (("0F0",), ((("float32",), (5, 3)),))) == ordering.DISCOVERY
    assert ordering.mode_for(key, key, ordering.DYNAMIC) == ordering.DISCOVERY


def test_unknown_shapes_option_is_refused():
    with pytest.raises(PlanError, match=r"^shapes='sometimes': expected one of static, dynamic "
                                        r"\(dynamic when a model's shapes depend on values\)$"):
        ordering.mode_for(None, None, "sometimes")


def test_policy_per_backend():
    assert ordering.policy_for("nccl") == ordering.GROUPED
    assert ordering.policy_for("gloo") == ordering.GROUPED  # eager costs CPU on gloo (issue #14)
    assert ordering.policy_for("gloo", "eager") == ordering.EAGER


def test_eager_is_refused_under_nccl():
    with pytest.raises(PlanError, match=r"^BRIGADE_P2P_POLICY=eager deadlocks under NCCL \(receives posted "
                                        r"ahead of sends\): use grouped, or unset it$"):
        ordering.policy_for("nccl", "eager")


def test_unknown_requested_policy_is_refused():
    with pytest.raises(PlanError, match="^BRIGADE_P2P_POLICY='fastest': expected one of grouped, eager, "
                                        "or unset for the backend's default$"):
        ordering.policy_for("gloo", "fastest")


def test_grouped_issues_in_clock_order_one_send_per_batch():
    """Receives are posted as early as the clock allows (1RECV_F1 at the start), each send in
    a batch of its own with the receives that come after it in the clock."""
    plan = validate(build("1f1b", 2, 3))
    issues = ordering.posting(plan, 1, ordering.GROUPED)
    assert [(i.after, [str(a) for a in i.ops]) for i in issues] == [
        (ordering.BEGIN, ["1RECV_F0", "1RECV_F1"]), (1, ["1SEND_B0", "1RECV_F2"]),  # after comm #1
        (3, ["1SEND_B1"]), (5, ["1SEND_B2"])]


def test_grouped_orders_messages_by_when_they_are_produced_not_consumed():
    """1F1B, 3 stages: 0F2 ends at 3, as 1F1 does (a tie, broken by the producing stage), so
    1RECV_F2 joins 1SEND_F0's batch although stage 1 only consumes it after 1B0 (at 8, after
    stage 2 consumed 1SEND_F1's message at 6)."""
    plan = validate(build("1f1b", 3, 3))
    issues = ordering.posting(plan, 1, ordering.GROUPED)
    assert [(i.after, [str(a) for a in i.ops]) for i in issues] == [
        (ordering.BEGIN, ["1RECV_F0", "1RECV_F1"]), (1, ["1SEND_F0", "1RECV_F2"]),
        (3, ["1SEND_F1", "1RECV_B0"]), (5, ["1SEND_B0"]), (7, ["1SEND_F2", "1RECV_B1"]),
        (9, ["1SEND_B1", "1RECV_B2"]), (11, ["1SEND_B2"])]


def test_every_comm_action_is_issued_once():
    for policy in ordering.POLICIES:
        plan = validate(build("zb", 3, 5))
        acts = plan[1]
        ops = [a for i in ordering.posting(plan, 1, policy) for a in i.ops]
        assert sorted(ops) == sorted(a for a in acts if "SEND" in a.op or "RECV" in a.op)


def test_eager_posts_first_receives_at_begin():
    plan = validate(build("gpipe", 3, 2))
    first = [i.ops for i in ordering.posting(plan, 1, ordering.EAGER) if i.after == ordering.BEGIN]
    assert first == [(Action(1, "RECV_F", 0),), (Action(1, "RECV_B", 0),)]


def test_unknown_policy_is_refused():
    with pytest.raises(PlanError, match="^posting policy 'fast': expected one of grouped, eager$"):
        ordering.posting({0: []}, 0, "fast")


def test_a_rank_outside_the_plan_issues_nothing():
    plan = validate(build("1f1b", 2, 3))
    for policy in ordering.POLICIES:
        assert ordering.posting(plan, 2, policy) == [], policy


def test_the_message_clock_is_one_run_of_the_plan_at_f_1_and_b_2():
    clock = {(s, k.value, mb): t for (s, k, mb), t in ordering.message_clock(build("1f1b", 2, 3)).items()}
    assert clock == {
        (0, "F", 0): 1.0, (0, "F", 1): 2.0, (0, "B", 0): 6.0, (0, "F", 2): 7.0, (0, "B", 1): 9.0,
        (0, "B", 2): 12.0, (1, "F", 0): 2.0, (1, "B", 0): 4.0, (1, "F", 1): 5.0, (1, "B", 1): 7.0,
        (1, "F", 2): 8.0, (1, "B", 2): 10.0}


@pytest.mark.parametrize("rank, expected", [
    (0, [(ordering.BEGIN, ["0RECV_B0"]), (0, ["0SEND_F0"]), (1, ["0SEND_F1"]), (2, ["0RECV_B1"]),
         (3, ["0SEND_F2"]), (4, ["0RECV_B2"])]),
    (1, [(ordering.BEGIN, ["1RECV_F0"]), (0, ["1RECV_F1"]), (1, ["1SEND_B0"]), (2, ["1RECV_F2"]),
         (3, ["1SEND_B1"]), (5, ["1SEND_B2"])]),
])
def test_eager_posts_each_send_at_its_place_and_each_next_receive_once_the_last_arrived(rank, expected):
    plan = validate(build("1f1b", 2, 3))
    issues = ordering.posting(plan, rank, ordering.EAGER)
    assert [(i.after, [str(a) for a in i.ops]) for i in issues] == expected
