"""PyTorch's own `torch.distributed.pipelining`, driven on the same stages, for comparison."""

from __future__ import annotations

import torch
from torch import nn

# brigade's schedule names (pipeline/schedule.py's registry) that torch.distributed.pipelining
# also has, and its class for each: the comparison runs only these on both sides.
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def nearest_torch_schedule(schedule: str) -> str:
    """`schedule` if torch has it, else its closest torch relative (1F1B: zero-bubble's base)."""
    return schedule if schedule in TORCH_SCHEDULES else "1f1b"


class TorchPipelining:
    """One rank's stage under torch.distributed.pipelining's GPipe or 1F1B schedule."""

    def __init__(self, module: nn.Module, stage: int, n_stages: int, schedule: str,
                 n_microbatches: int, loss_fn, device: torch.device, group=None):
        from torch.distributed import pipelining

        self.module = module
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        pipe_stage = pipelining.PipelineStage(module, stage, n_stages, device, group=group)
        cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
        self.schedule = cls(pipe_stage, n_microbatches, loss_fn=loss_fn)

    def step(self, x: torch.Tensor | None, y: torch.Tensor | None) -> None:
        if self.is_first and self.is_last:
            self.schedule.step(x, target=y, losses=[])
        elif self.is_first:
            self.schedule.step(x)
        elif self.is_last:
            self.schedule.step(target=y, losses=[])
        else:
            self.schedule.step()
