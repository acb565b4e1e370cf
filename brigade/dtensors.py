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


def mesh_of(t: torch.Tensor):
    """The DeviceMesh a DTensor lives on, or None for a plain tensor. A fused (`_foreach`) op may
    take only tensors of one kind: all plain, or all DTensors on one mesh (under tensor parallel
    with data parallel, FSDP2's parameters are on two: 2-D outside the plan, 3-D inside)."""
    return t.device_mesh if isinstance(t, DTensor) else None
