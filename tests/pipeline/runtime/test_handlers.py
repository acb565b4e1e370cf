"""The handler map: one handler for every op kind a plan can hold, keyed by the `Op` Enum."""

from brigade.pipeline.plans.action import Op
from brigade.pipeline.runtime.handlers import HANDLERS


def test_every_op_kind_has_one_handler_keyed_by_the_enum():
    assert set(HANDLERS) == set(Op)
    assert all(isinstance(op, Op) for op in HANDLERS)
    assert len(set(HANDLERS.values())) == len(Op)  # no two kinds share a handler
