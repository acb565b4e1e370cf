"""A model's blocks as one of `tp` tensor-parallel processes runs them, measured in this process.

Tensor parallel is not its split share of the work and nothing more. On one tp process a block
runs its share of the matmuls, the parts it keeps whole (its norms' weights, an empty plan's
block) in full, every op on a DTensor through DTensor's dispatch, and the collectives its plan
issues (under sequence parallel two all-gathers and two reduce-scatters in a GPT block's forward,
six in its backward, its saved parts gathered again). On this machine's CPU a GPT block of
4 × 256 at 4 samples, its collectives free, took longer at tp 2 than whole at tp 1 (about 22
against 17 ms a forward and backward), and pricing only the split share and the all-reduces
predicted tp 2 × pp 2 at 0.39 of its measured step.

So the planner measures it, without a second process: the blocks are split as training splits
them (`parallel.assemble.split_blocks`: tensor parallel, sequence parallel, recompute) over a
world of `tp` processes that are not there (`world.mesh.fake_world`, torch's fake process group:
every collective returns at once, its output of the right shape, its contents whatever the
memory held). What it gives:

    times        (forward, backward, weight, input) seconds of every block at each micro-batch
                 size, as `costs.measure` times them at tp 1: this process's compute and the
                 dispatch, the collectives free
    collectives  per block, the collectives its forward issues and those its backward does
                 (`Collectives`): the prediction prices each one as the device says a collective
                 issued by DTensor costs (`DeviceSpec.tp_collective_s`, probed) plus its bytes
    working      per block and sample, what its backward holds beyond what it held after the
    transient    forward, and the allocator's peak beyond that, first and adding into gradients
    accumulating already made (`costs.ModeCosts`): `costs` measures these at tp 1,
                 where a block under tp holds other temporaries (its gathered inputs, the
                 reduce-scatters' buffers, DTensor's copies)

Measured in this process only when nothing else initialized torch.distributed here (`brigade
plan`, the accuracy benchmark's costs process); otherwise the planner prices tp from the tp 1
costs alone (`planner.predict`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from brigade.measure.collectives import Collectives
from brigade.measure.stages import block_costs
from brigade.parallel.assemble import split_blocks
from brigade.pipeline.batches.sample import runnable, take

TP = 2  # the degree measured: a node's smallest split, the one this machine can run


@dataclass
class SplitCosts:
    """One recompute mode's blocks on one of `tp` processes (module docstring); memory in bytes
    per sample."""

    tp: int
    times: dict[int, list[tuple[float, ...]]]
    collectives: list[tuple[int, int]]  # per block: (forward, backward)
    working: list[float]
    transient: list[float]
    accumulating: list[float] = field(default_factory=list)


def measure_split(blocks, x, y, loss_fn, sizes: list[int], mode: str, mesh, memory,
                  repeats: int) -> SplitCosts:
    """The `SplitCosts` of `blocks` under recompute `mode` on rank 0 of the fake world `mesh`, on
    the batch x, y (its first `size` samples for each of `sizes`). `memory(blocks, x, y, s)`:
    costs' own per-block (held, working, transient, kept, accumulating) per sample."""
    split = copy.deepcopy(blocks)
    split_blocks(split, list(range(len(split))), mesh, mode)
    times = {}
    for s in sizes:
        h, bound = runnable(split, take(x, s))
        times[s] = block_costs(bound, h, loss_fn, take(y, s), repeats=repeats)
    s = min(sizes)
    _, working, transient, _, accumulating = memory(split, x, y, s)
    return SplitCosts(mesh.size(), times, _collectives(split, take(x, s), loss_fn, take(y, s)),
                      working, transient, accumulating)


def _collectives(blocks, x, loss_fn, y) -> list[tuple[int, int]]:
    """Per block, (forward, backward) collectives issued, block by block as `block_costs` runs them."""
    out = []
    h, bound = runnable(blocks, x)
    for i, block in enumerate(bound):
        last = i == len(bound) - 1
        inp = h.detach().requires_grad_(h.is_floating_point() and i > 0)
        with Collectives() as forward:
            top = block(inp)
            loss = loss_fn(top, y) if last else top
        with Collectives() as backward:
            torch.autograd.backward(loss, None if last else torch.ones_like(loss))
        block.zero_grad(set_to_none=True)
        out.append((forward.n, backward.n))
        h = top.detach()
    return out
