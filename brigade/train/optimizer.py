"""The optimizer a run steps with and its learning rate at each step: AdamW with weight decay on
matrices only, grouped so that its fused and foreach updates never mix kinds of tensor, and a
linear warm-up into --lr-schedule's decay (`config.lr`: cosine, wsd, linear or constant).
`Trainer` uses both; the planner prices the same update."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from brigade.config import OptimConfig
from brigade.config.lr import decay_end
from brigade.config.optimizer import flags, resolve
from brigade.dtensors import mesh_of


def _cosine(progress: float) -> float:
    return 0.5 * (1 + math.cos(math.pi * progress))


def _wsd(progress: float, fraction: float) -> float:
    """Held at 1 until the last `fraction` of the decay's span, then a straight line to 0."""
    return min(1.0, (1 - progress) / fraction)


# After the warm-up: the part of (lr - min_lr) left at `progress` ∈ [0, 1] of the decay's span.
# One per name of `config.lr.LR_SCHEDULES` (tests/train/test_optimizer.py holds the two equal).
SHAPES: dict[str, Callable[[float, float], float]] = {
    "cosine": lambda progress, fraction: _cosine(progress),
    "wsd": _wsd,
    "linear": lambda progress, fraction: 1 - progress,
    "constant": lambda progress, fraction: 1.0,
}


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Linear warm-up to `lr` over `warmup_steps`, then --lr-schedule's way down to `min_lr` on
    step `decay_steps` (0: `max_steps`), and `min_lr` after it."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    span = max(1, decay_end(cfg.decay_steps, max_steps) - cfg.warmup_steps)
    progress = min(1.0, max(0.0, (step - cfg.warmup_steps) / span))
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * SHAPES[cfg.lr_schedule](progress, cfg.decay_fraction)


def adamw(cfg: OptimConfig) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """AdamW with weight decay on matrices only (not biases, norms, or embeddings' gains).

    Under tensor parallel some parameters are DTensors, on one mesh or two, and some plain
    tensors; AdamW's fused and foreach updates may not mix kinds in one group
    (`dtensors.mesh_of`), so each kind has its own groups. The update is --adamw's, resolved for
    the parameters' device where it is "auto" (`config.optimizer.resolve`)."""

    def make(model: nn.Module) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        kinds = list(dict.fromkeys(mesh_of(p) for p in params))
        groups = [{"params": [p for p in params if (p.dim() >= 2) == matrix and mesh_of(p) == kind],
                   "weight_decay": cfg.weight_decay if matrix else 0.0}
                  for matrix in (True, False) for kind in kinds]
        # No empty groups: a snapshot maps groups to parameter names, and an empty one has none.
        groups = [g for g in groups if g["params"]]
        update = resolve(cfg.adamw, params[0].device.type if params else "cpu")
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **flags(update))

    return make
