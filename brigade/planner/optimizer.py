"""What the optimizer step costs, measured here on a model's parameters: AdamW as the trainer runs it
(clipping, the step, zeroing).

    seconds_per_byte      the step's median seconds per parameter byte (the planner scales it to
                          the target by memory bandwidth: `costs.scaled`)
    optimizer_transient   per block, the bytes the step allocates beyond its state, and whether a
                          step over several blocks allocates their sum (a foreach update) or the
                          largest (one tensor at a time, as on this CPU)
    foreach_transient     the same for a GPU's foreach update, from the parameter bytes alone
"""

from __future__ import annotations

import gc
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from brigade.models import ModelSpec
from brigade.train.memory import cpu_peak


def seconds_per_byte(spec: ModelSpec, repeats: int = 5) -> float:
    """Median seconds per parameter byte of AdamW's step, the gradient norm and zeroing."""
    params = [
        p.detach().clone().requires_grad_()
        for p in {id(p): p for b in spec.blocks for p in b.parameters()}.values()
    ]
    if not params:
        return 0.0
    opt = torch.optim.AdamW(params)
    times = []
    for _ in range(repeats + 1):
        for p in params:
            p.grad = torch.zeros_like(p)
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return statistics.median(times[1:]) / nbytes


def optimizer_transient(blocks) -> tuple[list[float], bool]:
    """(per block, the bytes AdamW's second step allocates beyond its state, gradients and
    parameters, clipping included; whether a step over several blocks allocates their sum).

    The second step, because the first creates the state. Which of the two it is depends on
    the update torch picks here (one tensor at a time on a CPU: about twice the largest
    parameter; foreach: a copy of them all), so it is read from the whole model's step: the
    sum when that step allocates more than half again the largest block's."""
    per = [_step_bytes([p for p in b.parameters()]) for b in blocks]
    whole = _step_bytes([p for p in {id(p): p for b in blocks for p in b.parameters()}.values()])
    return per, sum(1 for x in per if x) > 1 and whole > 1.5 * max(per)


def foreach_transient(params: list[dict[int, int]]) -> list[float]:
    """Per block, what AdamW's foreach update (a GPU's default) allocates beyond its state: about
    a copy of the block's parameters (`params`: per block, parameter id -> bytes)."""
    return [float(sum(b.values())) for b in params]


def _step_bytes(owned: list[torch.Tensor]) -> float:
    """What one AdamW step (with clipping, as the trainer runs it) allocates on `owned`'s copies."""
    params = [p.detach().clone().requires_grad_() for p in owned if p.requires_grad]
    if not params:
        return 0.0
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    return float(cpu_peak(prof))
