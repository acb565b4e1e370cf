"""What FSDP2's own work adds to each block of a sharded stage, measured in this process.

A sharded block costs more than its forward and backward and the collectives that move its bytes.
Around every all-gather FSDP2 copies the shards into one flat buffer and the gathered buffer back
out into the block's parameters; around every reduce-scatter it copies the gradients into one
buffer and the reduced shard out; its hooks run before and after each forward and backward, and
every parameter is a DTensor. On this machine's CPU that is compute on the same cores as the
block's own: the GPT of the accuracy benchmark (4 blocks of 4 × 256, 8 samples) took 116 ms a
forward and backward sharded over two processes whose collectives cost nothing, against 96 ms
whole, and the planner, which priced only the collectives' bytes, predicted sharded data
parallel 12-25 % fast.

So the planner measures it as it measures tensor parallel (`split_costs`): each block, alone,
sharded as training shards a stage (`parallel.shard.shard_stage`: the block its own unit under a
root; its weights freed after its forward and gathered again for its backward, as without a
pipeline; FSDP2's mixed precision in a half-precision run) over a world of two processes that
are not there (`world.mesh.fake_world`: each collective returns at once), its forward and
backward timed in turn with the same block unsharded. The difference is one cycle of FSDP2's
work on the block: two gathers and one reduction, copies and hooks included, the collectives
free. It hardly depends on the shard degree (the copies are of the whole block: the gathered
weights, the gradients before they are reduced), so the prediction reads it at every degree
(`reduction.after_pipeline`).

Measured only where this process can fake a world (`brigade plan`, the accuracy benchmark's
costs process), and read only where the target is this machine: on a GPU FSDP2 copies on its
own streams, alongside the compute.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from torch import nn

from brigade.parallel.shard import shard_stage
from brigade.pipeline.batches.sample import Bound, runnable

WARMUPS = 2


def measure_shard(blocks: list[nn.Module], x, y, loss_fn, dtype: torch.dtype | None, mesh,
                  repeats: int) -> list[float]:
    """Per block, the seconds one FSDP2 cycle (gather, forward, gather, backward, reduce: module
    docstring) adds to its forward and backward on the batch x, y, on rank 0 of the fake world
    `mesh`; 0 for a block without parameters. `dtype`: the run's half precision (the unsharded
    block timed in it, the sharded one gathering into it), None: fp32."""
    h, plain = runnable([copy.deepcopy(b) for b in blocks], x)  # each its own: ties are untied
    if dtype is not None:
        plain = [b.to(dtype) for b in plain]
        h = h.to(dtype) if h.is_floating_point() else h
    out = []
    for i, (block, whole) in enumerate(zip(blocks, plain)):
        loss = loss_fn if i == len(plain) - 1 else None
        if any(True for _ in block.parameters()):
            sharded = _sharded(block, mesh, dtype)
            if isinstance(whole, Bound):
                sharded = Bound(sharded, whole.side)
            plain_s, sharded_s = _in_turn([whole, sharded], h, loss, y, repeats)
            out.append(max(0.0, sharded_s - plain_s))
        else:
            out.append(0.0)
        with torch.no_grad():
            h = whole(h)
    return out


class _Root(nn.Module):
    """A stage of one block, called as the block is (`parallel.shard.shard_stage` shards the
    block as its own unit, then this root, as it shards a stage's blocks and then the stage)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return self.block(*args, **kwargs)


def _sharded(block: nn.Module, mesh, dtype: torch.dtype | None) -> nn.Module:
    """A copy of `block` sharded over `mesh` as training shards a stage without a pipeline."""
    return shard_stage(_Root(copy.deepcopy(block)), mesh, reshard=True, param_dtype=dtype)


def _in_turn(modules: list[nn.Module], h, loss_fn, y, repeats: int) -> list[float]:
    """Each module's median seconds of a forward and backward on `h`, the modules timed in turn
    so that a slow moment slows them alike."""
    times: list[list[float]] = [[] for _ in modules]
    for _ in range(WARMUPS + repeats):
        for k, module in enumerate(modules):
            inp = h.detach().requires_grad_(h.is_floating_point())
            start = time.perf_counter()
            top = module(inp)
            loss = loss_fn(top, y) if loss_fn is not None else top
            torch.autograd.backward(loss, None if loss_fn is not None else torch.ones_like(loss))
            times[k].append(time.perf_counter() - start)
            module.zero_grad(set_to_none=True)
    return [statistics.median(t[WARMUPS:]) for t in times]
