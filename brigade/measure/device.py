"""Where a bench process works: its model, its batch and its DDP wrapper, on the process's device.

Every bench worker (bench, tune, speed, overhead) takes its device from one place, the
`DistInfo.device` that `brigade.launcher.groups.init()` returns (cuda:local_rank under NCCL, the CPU
under gloo), and places its model and batch through `place_model`. `ddp` is the tutorial's plain
DDP, the baseline `results.overhead` holds brigade's loop against; brigade's own rows are built
by the stage assembler, as `brigade train` builds them (`bench.experiments.worlds`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from brigade.models import ModelSpec


def place_model(spec: ModelSpec, batch_size: int, seed: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Move `spec`'s blocks to `device` (in place) and make its seeded batch there.

    Returns:
        (inputs, targets) of `batch_size` samples on `device`; the same on every rank for a seed.
    """
    for block in spec.blocks:
        block.to(device)
    x, y = spec.make_batch(batch_size, torch.Generator().manual_seed(seed))  # CPU: same on every rank
    return x.to(device), y.to(device)


def ddp(module: nn.Module, device: torch.device) -> DistributedDataParallel:
    """`module` on `device`, wrapped in DDP; on CUDA DDP is told its one device (`device_ids`)."""
    module = module.to(device)
    ids = [device] if device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids)
