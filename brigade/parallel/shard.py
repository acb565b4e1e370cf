"""Sharded data parallel: FSDP2's `fully_shard` on a stage's blocks, then on the stage itself.

Each block that owns parameters becomes its own FSDP unit (all-gathered and freed as one), and
the stage's root takes whatever is left (a parameter two blocks of the stage share, buffers of
the root). The mesh is the data-parallel part of the DeviceMesh: 1-D (shard) for FSDP, 2-D
(replicate, shard) for HSDP, where each shard group holds one full copy and the replicas
all-reduce the reduce-scattered gradients.

    stage s ── fully_shard(block) for each block ── fully_shard(stage)      (torchtitan's order)

Without a pipeline (the whole model one stage, a whole backward) FSDP runs as torchtitan runs
it: each block's weights are all-gathered for its forward and freed after it, gathered again for
its backward, whose gradients are reduce-scattered as it ends (`reshard_after_forward=True`, and
`runtime.reduce.ShardedReducer` leaves the reduction to FSDP). A rank then holds one or two
blocks gathered at a time, whatever the model's size.

Under a pipeline the gradient reduction is not FSDP's own: the runtime holds it off for every
backward of the step and reduce-scatters once at its end (`runtime.reduce.ShardedReducer`).
By default the parameters stay gathered from the step's first forward to that reduction, so a
stage all-gathers once per step and not once per micro-batch (`reshard_after_forward=False`,
as torchtitan does under a pipeline); `reshard=True` frees them after each forward, for less
memory and one all-gather per micro-batch more.

    no pipeline   block k: gather ─ F ─ free ... gather ─ B ─ reduce-scatter, free
    pipeline      stage:   gather ─ F F F ... B B B ─ reduce-scatter once, free

Mixed precision (`--precision bf16` or fp16 under sharding) is FSDP2's own policy, as torchtitan
and every large run use it: the shards stay fp32 (the master weights, their gradients and AdamW's
moments: 16 bytes a parameter, ÷ shard), the all-gather casts them to bf16, so the gathered weights
a stage computes with are bf16 copies, its activations are bf16, and the gradients are reduced
(reduce-scattered, all-reduced over HSDP's replicas) in fp32. The pipeline then runs without
autocast: every matmul is bf16 already, and autocast would only keep norms and softmaxes, and so
the residual stream, in fp32. The loss stays fp32 (`pipeline.runtime.handlers._loss`).

    shard (fp32) ─ all-gather as bf16 ─► gathered bf16 ─► forward, backward in bf16
    bf16 gradient ─ cast to fp32 ─ reduce-scatter ─► shard's gradient (fp32) ─► AdamW (fp32)
"""

from __future__ import annotations

import torch
from torch import nn


def _shared_within(blocks: list[nn.Module]) -> set[int]:
    """ids of parameters that more than one of `blocks` holds (a tie inside one stage)."""
    seen: dict[int, int] = {}
    for k, block in enumerate(blocks):
        for p in block.parameters():
            if seen.setdefault(id(p), k) != k:
                seen[id(p)] = -1
    return {pid for pid, k in seen.items() if k == -1}


def shard_policy(param_dtype: torch.dtype | None):
    """FSDP2's mixed precision for gathered weights of `param_dtype` (the module docstring): fp32
    reductions; None: fp32 throughout."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) \
        if param_dtype is not None else MixedPrecisionPolicy()


def shard_stage(module: nn.Module, mesh, reshard: bool = False,
                param_dtype: torch.dtype | None = None) -> nn.Module:
    """Wrap a stage's blocks and then the stage with `fully_shard` over `mesh`, in place.

    A block holding a parameter another block of the stage also holds is left to the root (one
    FSDP unit may own a parameter, and the root then owns it once).

    Args:
        module: the stage (an nn.Sequential or StageModule of blocks).
        mesh: the data-parallel DeviceMesh: 1-D (shard) or 2-D (replicate, shard).
        reshard: free the gathered parameters after each forward (see the module docstring).
        param_dtype: the gathered weights' dtype, bf16 or fp16 (FSDP2's mixed precision: the
            shards stay fp32, gradients are reduced in fp32); None: fp32 throughout.

    Returns:
        `module`, now an FSDPModule whose parameters are sharded DTensors.
    """
    from torch.distributed.fsdp import fully_shard

    policy = shard_policy(param_dtype)
    blocks = list(module.children())
    shared = _shared_within(blocks)
    for block in blocks:
        params = list(block.parameters())
        if params and not any(id(p) in shared for p in params):
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    return module
