"""A tensor's part here and its whole, whether or not it is a sharded DTensor (FSDP2's parameters
and gradients are; everything else brigade holds is a plain tensor)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of `t`: a DTensor's local shard (a view), or `t` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole of `t`: a DTensor gathered from every shard (a collective), or `t` itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t
