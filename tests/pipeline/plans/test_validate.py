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
])
def test_validate_names_the_offending_action(rows, message):
    with pytest.raises(PlanError, match=message):
        validate(parse_plan(rows))
