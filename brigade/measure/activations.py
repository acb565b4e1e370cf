"""Peak memory of a stage's step, measured the best way its device allows.

    CPU    "saved-tensors": no allocator counter to read, so brigade counts what it can see:
           every tensor autograd saves for backward, once per storage, while it is alive.
    CUDA   "allocator": the caching allocator's own peak over the step, above what was
           allocated when the step began (activations, gradients, workspaces: all of it).

`stage_meter(device)` picks one; both are context managers with `peak_bytes` and `method`.
"""

from __future__ import annotations

import torch

from brigade.parallel.held import Held
from brigade.train.memory import AllocatorPeak


def stage_meter(device: torch.device, exclude=()) -> ActivationMeter | AllocatorPeak:
    """The meter for a step on `device`: the allocator's peak on CUDA, saved tensors elsewhere.

    Args:
        device: where the stage runs (the process's device).
        exclude: tensors not to count on CPU (e.g. the weights); the allocator's peak is taken
            above the memory already allocated at the start, which holds them.
    """
    if device.type == "cuda":
        return AllocatorPeak(device)
    return ActivationMeter(exclude=exclude)


class ActivationMeter(Held):
    """Context manager: `peak_bytes` of saved-for-backward tensors alive at once (`parallel.held`,
    whose counting `brigade train` reports as activations)."""

    method = "saved-tensors"

    @property
    def peak_bytes(self) -> int:
        return self.peak
