"""`validate`: the first offending action of a bad plan named, communication checked and inserted."""

import pytest

from brigade.pipeline.plans.action import Action, PlanError
from brigade.pipeline.plans.validate import validate


def parse_plan(rows):
    return {r: [Action.parse(t) for t in row.split()] for r, row in enumerate(rows)}


@pytest.mark.parametrize("rows,message", [
    (["0B0 0F0", "1F0 1B0"], "0B0 comes before 0F0"),
    (["0F0 0F1 0B0 0B1", "1F1 1F0 1B0 1B1"], "1F1: stage 1 runs micro-batch 1 as its #0 F"),
    # the backward order too: stage 1 sends micro-batch 0's gradient first, stage 0 takes 1's
    (["0F0 0F1 0B1 0B0", "1F0 1F1 1B0 1B1"], "0B1: stage 0 runs micro-batch 1 as its #0 B"),
    (["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"], "deadlock: ranks wait forever at 0RECV_B0"),
    (["0F0 0F1 0B0", "1F0 1F1 1B0 1B1"], "stage 0 never runs 0B1"),
    (["0F0 0F0 0B0", "1F0 1B0"], "0F0 appears twice on rank 0"),
    (["0F0 0B0", "0F0 1B0"], "0F0 is listed under rank 1"),
    (["0F0 0SEND_F0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"], "rank 0: found 0B0 where 0RECV_B0 belongs"),
    # every prefix matches, but rank 1 stops short of its gradient's send
    (["0F0 0SEND_F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0"], "^communication does not match the compute actions$"),
    # a whole backward beside a split one, even with its W missing (B and I alone are refused too)
    (["0F0 0I0 0B0"], r"^0B0 and a split backward 0I0/0W0 both present: use one or the other$"),
    (["0F0 0I0 0W0 0B0"], r"^0B0 and a split backward 0I0/0W0 both present"),
    (["0F0 0I0"], "^stage 0 never runs 0W0$"),
    (["0F0 0W0 0I0"], "^0W0 comes before 0I0$"),
    (["0I0 0F0 0W0"], "^0I0 comes before 0F0$"),
    (["0F0 0F2 0B0 0B2"], r"^0F2: micro-batch out of range 0\.\.1$"),
    (["0F0 0F1 0B0 0B1", "1F0 1B0"], "^stage 1 never runs 1F1$"),
    (["0F0 0B0", "2F0 2B0"], r"^no rank runs stage 1: stages must be 0\.\.S-1$"),
    # a forward waiting on a forward (stage 2 before stage 0 on rank 0): the receives it waits at
    (["2F0 0F0", "1F0"], "^deadlock: ranks wait forever at 2RECV_F0, 1RECV_F0$"),
    # rank 0 is done; ranks 1 and 2 wait on each other
    (["0F0", "3F0 1F0", "2F0"], "^deadlock: ranks wait forever at 3RECV_F0, 2RECV_F0$"),
    (["0F0 0B0", "0F0 1B0"],
     "^0F0 is listed under rank 1 but stage 0 runs on rank 0: a stage lives on one rank$"),
    # stages 1 and 2 share rank 1 (handed over by reference): the pair after them is still checked
    (["0F0 0F1", "1F0 2F0 1F1 2F1", "3F1 3F0"],
     "^3F1: stage 3 runs micro-batch 1 as its #0 F but stage 2 produces 0 there; neighbouring stages "
     "must agree on order$"),
])
def test_validate_names_the_offending_action(rows, message):
    with pytest.raises(PlanError, match=message):
        validate(parse_plan(rows))


@pytest.mark.parametrize("plan,message", [
    ({}, "^empty plan: expected one action list per rank$"),
    ({0: [Action.parse("0F0"), Action.parse("0B0")], 2: [Action.parse("1F0"), Action.parse("1B0")]},
     r"^ranks \[0, 2\]: expected 0\.\.1$"),
    # a stage below 0: no stage is missing below the highest, so the message names stage 0
    ({0: [Action(-1, "F", 0), Action(-1, "B", 0)]}, r"^no rank runs stage 0: stages must be 0\.\.S-1$"),
    ({0: [Action(-1, "F", 0), Action(-1, "B", 0)], 1: [Action(0, "F", 0), Action(0, "B", 0)]},
     r"^no rank runs stage 0: stages must be 0\.\.S-1$"),
    ({0: [Action(0, "F", -1), Action(0, "B", -1)]}, r"^0F-1: micro-batch out of range 0\.\.0$"),
])
def test_validate_refuses_a_plan_that_no_parse_can_write(plan, message):
    with pytest.raises(PlanError, match=message):
        validate(plan)


def test_validate_inserts_the_communication_and_takes_it_back_unchanged():
    plan = parse_plan(["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"])
    full = validate(plan)
    assert {r: " ".join(map(str, acts)) for r, acts in full.items()} == {
        0: "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        1: "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
    }
    assert validate(full) == full


def test_validate_accepts_split_backwards_and_forward_only_plans():
    split = parse_plan(["0F0 0F1 0I0 0W0 0I1 0W1", "1F0 1I0 1F1 1I1 1W0 1W1"])
    assert [a.op for a in validate(split)[1]] == ["RECV_F", "F", "I", "SEND_B", "RECV_F", "F", "I", "SEND_B",
                                                  "W", "W"]
    # a forward-only plan has no backward to check (one B anywhere would make every stage need them)
    assert validate(parse_plan(["0F0 0F1", "1F0 1F1"]))[1] == parse_plan(["1RECV_F0 1F0 1RECV_F1 1F1"])[0]
    with pytest.raises(PlanError, match="^stage 0 never runs 0B0$"):
        validate(parse_plan(["0F0", "1F0 1B0"]))
