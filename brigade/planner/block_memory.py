"""What each block holds and allocates through its forward and backward, measured here: the
memory columns of `planner.costs` (its module docstring says what each one is).

    held, working, transient   `_block_memory`, one forward and backward under the step meter
                               (`train.memory.StepMemory`)
    accumulating               the same for a backward that adds into gradients already made,
                               less the block's largest gradient (`largest_grad`)
    kept                       `_kept`: what the runtime's own `backward_split` leaves allocated
                               from the input pass to the weight pass
"""

from __future__ import annotations

import gc
import types

import torch
from torch.profiler import ProfilerActivity, profile

from brigade.dtensors import local
from brigade.pipeline.batches.sample import runnable, take
from brigade.pipeline.runtime.backward import backward_split
from brigade.train.memory import StepMemory, storage_bytes


def block_memory(loss_fn, blocks, x, y, s: int) -> tuple[list[float], ...]:
    """Per block, bytes per sample: (held, working, transient, kept, accumulating) on the first `s`
    samples of the batch x, y (`_block_memory`, `_kept`); `loss_fn` ends the last block."""
    h, blocks = runnable(blocks, take(x, s))
    y = take(y, s)
    held, working, transient, kept, accumulating = [], [], [], [], []
    for i, block in enumerate(blocks):
        last = loss_fn if i == len(blocks) - 1 else None
        f, p, t = _block_memory(block, h, last, y, first=i == 0)
        held.append(f / s)
        working.append(max(0.0, p - f) / s)
        transient.append(max(0.0, t) / s)
        kept.append(max(0, _kept(block, h, last, y, first=i == 0)) / s)
        again = _block_memory(block, h, last, y, first=i == 0, accumulate=True)[2]
        accumulating.append(max(0.0, again - largest_grad(block)) / s)
        with torch.no_grad():
            h = block(h)
    return held, working, transient, kept, accumulating


def largest_grad(block) -> int:
    """Bytes of the block's largest fp32 gradient here (a split parameter's part): what a backward
    that adds into gradients already made holds at once beyond them (the new one, before it is
    added)."""
    return max((local(p).numel() * 4 for p in block.parameters() if p.requires_grad), default=0)


def _block_memory(block, h, loss_fn, y, first: bool, accumulate: bool = False) -> tuple[int, int, int]:
    """(held after forward, held at most, allocator peak beyond params, grads and held) bytes;
    `accumulate`: of a backward that adds into gradients an earlier one made (a pipeline's later
    micro-batches)."""
    params = list(block.parameters())
    for _ in range(2):  # the second is measured: the first allocates what stays (lazy buffers)
        block.zero_grad(set_to_none=True)
        if accumulate:
            _forward_backward(block, h, loss_fn, y, first)
        with StepMemory(params, types.SimpleNamespace(state={}), h.device) as mem:
            after = _forward_backward(block, h, loss_fn, y, first, mem)
            mem.grads_ready([p.grad for p in params])
        r = mem.report()
    block.zero_grad(set_to_none=True)
    return after, r["activations"], r["peak"] - r["params"] - r["grads"] - r["activations"]


def _forward_backward(block, h, loss_fn, y, first: bool, mem: StepMemory | None = None) -> int:
    """One forward and backward of the block on h; the bytes `mem` held after the forward."""
    inp = h.detach().requires_grad_(h.is_floating_point() and not first)
    out = block(inp)
    after = mem.held.now if mem is not None else 0
    if loss_fn is not None:
        out = loss_fn(out, y)
    torch.autograd.backward(out, None if loss_fn is not None else torch.ones_like(out))
    return after


def _kept(block, h, loss_fn, y, first: bool) -> int:
    """Bytes a split backward keeps from the input pass to the weight pass (module docstring).

    What the runtime's `backward_split` leaves allocated when it returns, counted from the
    allocator's events (as `train.memory` counts a CPU step's peak): the forward ran before, so
    its tensors are not counted, and the gradient that comes back (made inside, as a received one
    is) counts only where the input pass keeps it. Block 0's input takes no gradient, so its
    figure is its output's gradient, which the runtime keeps whole until W (`_whole`).
    """
    params = [p for p in block.parameters() if p.requires_grad]
    for _ in range(2):  # the second is measured: the first allocates what stays (lazy buffers)
        block.zero_grad(set_to_none=True)
        inp = h.detach().requires_grad_(h.is_floating_point() and not first)
        out = block(inp)
        top = loss_fn(out, y) if loss_fn is not None else out
        gc.collect()  # no garbage of before (another caller's cycles) freed inside the count
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            grad = None if loss_fn is not None else torch.ones_like(out)
            dx, weight_step = backward_split([top], [grad], [inp], params)
            del dx, grad
        made = storage_bytes(p.grad for p in params)  # a tied weight's, added in the input pass
        del weight_step, top, out, inp  # W never runs: dropping the graph frees what it kept
    block.zero_grad(set_to_none=True)
    return _net_bytes(prof) - made


def _net_bytes(prof) -> int:
    """Bytes allocated and not freed while the profiler ran (its CPU memory events' sum)."""
    return sum(e.nbytes() for e in prof.profiler.kineto_results.events()
               if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
