"""One step's state on one rank: what the interpreter's handlers read and update.

`StageRunner.run` makes a `Step` from the step's actions and micro-batches; each handler
(`handlers.py`) takes what an earlier action left (an activation received, an output held for
its backward, a gradient to send) and leaves what a later one needs. A missing entry means
the action list is out of order, and `Step.take` says which action found nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from brigade.pipeline.plans.action import Action, B, I, PlanError, W
from brigade.pipeline.runtime.reduce import Reducer


@dataclass
class StepResult:
    """What one rank got out of one step."""

    loss: torch.Tensor | None = None  # rank of the last stage: weighted sum of micro-batch losses
    outputs: list = field(default_factory=list)  # last stage, if asked (tensors or structures)
    trace: list[tuple[Action, float, float]] = field(default_factory=list)


Key = tuple[int, int]  # (stage, micro-batch)


@dataclass
class Step:
    """One step's state, shared by the action handlers (`handlers.py`) of `StageRunner`."""

    actions: list[Action]
    inputs: list | None
    targets: list | None
    weights: list[float] | None
    keep_outputs: bool
    sync: bool
    side: list[dict] | None = None  # per micro-batch: {side input name: value} for this rank's stages
    result: StepResult = field(default_factory=StepResult)
    held: dict[Key, tuple] = field(default_factory=dict)  # (stage input, output or loss), until B/W
    acts: dict[Key, torch.Tensor] = field(default_factory=dict)  # activations a forward will take
    grads: dict[Key, torch.Tensor] = field(default_factory=dict)  # gradients a backward will take
    outgoing: dict[Key, torch.Tensor] = field(default_factory=dict)  # input gradients to send
    weight_steps: dict[Key, Callable] = field(default_factory=dict)  # pending W of (stage, mb)
    total: torch.Tensor | None = None
    reducers: dict[int, Reducer] = field(default_factory=dict)  # stage -> its reducer
    remaining: dict[int, int] = field(default_factory=dict)  # stage -> backward/weight passes left

    def __post_init__(self) -> None:
        self.training = any(a.op in (B, I) for a in self.actions)
        for a in self.actions:
            if a.op == B or a.op == W:
                self.remaining[a.stage] = self.remaining.get(a.stage, 0) + 1

    def take(self, store: dict, a: Action, what: str, stage: int | None = None):
        """Remove and return (stage, micro-batch)'s entry, or name the action that lacks it."""
        key = (a.stage if stage is None else stage, a.microbatch)
        if key not in store:
            raise self.missing(a, what)
        return store.pop(key)

    def finished(self, stage: int) -> bool:
        """Count one backward or weight pass of `stage`; True for its last of the step."""
        self.remaining[stage] -= 1
        return self.remaining[stage] == 0

    @staticmethod
    def missing(a: Action, what: str) -> PlanError:
        return PlanError(f"{a}: no {what} for micro-batch {a.microbatch} on stage {a.stage} at this point: "
                         "the action list is out of order (check it with plans.validate.validate)")
