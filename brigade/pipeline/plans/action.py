"""What a plan is made of: op kinds, placements, and the action `1F3` (stage 1's forward of
micro-batch 3). Closed sets are Enums; each member is also its one-letter (or SEND_F-like)
string, so plans print, parse and compare as they always did (`Op.F == "F"`). No torch import.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from brigade.errors import BrigadeError


class Op(str, Enum):
    """An action's kind. F forward; B whole backward, or split in two: I (input gradient, sent
    upstream at once) and W (weight gradient, deferred into bubbles); sends and receives are
    inserted by `schedule.with_comms`, never written by hand."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 -- the zero-bubble paper's name
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    def __str__(self) -> str:
        return self.value


F, B, I, W = Op.F, Op.B, Op.I, Op.W  # noqa: E741
SEND_F, RECV_F, SEND_B, RECV_B = Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B
COMPUTE_OPS = (F, B, I, W)
COMM_OPS = (SEND_F, RECV_F, SEND_B, RECV_B)


class Placement(str, Enum):
    """Stage → rank: SINGLE stage s on rank s; LOOP stage s on rank s mod p; V_SHAPE down the
    ranks and back up (rank 0 holds the first and the last stage)."""

    SINGLE = "single"
    LOOP = "loop"
    V_SHAPE = "v"

    def __str__(self) -> str:
        return self.value


SINGLE, LOOP, V_SHAPE = Placement.SINGLE, Placement.LOOP, Placement.V_SHAPE
PLACEMENTS = tuple(Placement)

Plan = dict[int, list["Action"]]
Builder = Callable[[int, int, int], Plan]  # (n_ranks, n_microbatches, n_virtual) -> plan

_ACTION_RE = re.compile(r"^(\d+)(" + "|".join(sorted((o.value for o in Op), key=len, reverse=True))
                        + r")(\d+)$")


class PlanError(BrigadeError, ValueError):
    """A plan that cannot run: the message names the offending action."""


@dataclass(frozen=True, order=True)
class Action:
    """One step of one stage: `op` on micro-batch `microbatch`. Prints as ``1F3``."""

    stage: int
    op: Op
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op}{self.microbatch}"

    __repr__ = __str__

    @staticmethod
    def parse(text: str) -> Action:
        """Parse ``"1F3"`` or ``"0SEND_B2"`` back into an Action.

        Raises:
            PlanError: if the text is not an action.
        """
        match = _ACTION_RE.match(text.strip())
        if not match:
            raise PlanError(f"cannot parse action {text!r}: expected STAGE OP MB, like '1F3'")
        return Action(int(match[1]), Op(match[2]), int(match[3]))
