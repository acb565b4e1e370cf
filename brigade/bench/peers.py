"""PyTorch's own `torch.distributed.pipelining`, driven on the same stages, for comparison."""

from __future__ import annotations

import torch
from torch import nn


class TorchPipelining:
    """One rank's stage under torch.distributed.pipelining's GPipe or 1F1B schedule."""

    def __init__(self, module: nn.Module, stage: int, n_stages: int, schedule: str,
                 n_microbatches: int, loss_fn, device: torch.device, group=None):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.module = module
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        pipe_stage = PipelineStage(module, stage, n_stages, device, group=group)
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
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
        self.module.zero_grad(set_to_none=True)
