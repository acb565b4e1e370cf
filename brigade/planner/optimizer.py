"""What the optimizer step costs, measured here on a model's parameters: AdamW as the trainer runs it
(clipping, the step, zeroing), with the update the trainer picks by default (--adamw auto:
fused on the CPU and on CUDA, `config.optimizer`).

    seconds_per_byte      the step's median seconds per parameter byte (the planner scales it to
                          the target by memory bandwidth: `scaling.scaled`)
    optimizer_transient   per block, the bytes the step allocates beyond its state, and whether a
                          step over several blocks allocates their sum (a foreach update) or the
                          largest (one tensor at a time)
    gpu_transient         the same for a GPU, from the parameter bytes alone: nothing for the
                          fused update, a copy of the parameters for a foreach one

What each update allocates, measured here on four 1024 × 1024 matrices and a vector (16 MiB):
one tensor at a time 12 MiB (about three times the largest), foreach 16 MiB (a copy of them
all), fused nothing (it updates in place; its step took 2 ms against 11 and 71).
"""

from __future__ import annotations

import gc
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from brigade.config.optimizer import flags, resolve
from brigade.models import ModelSpec
from brigade.train.memory import cpu_peak

UPDATE = "auto"  # the trainer's default --adamw: what a run that does not say uses


def _adamw(params: list[torch.Tensor], device_type: str = "cpu") -> torch.optim.AdamW:
    return torch.optim.AdamW(params, **flags(resolve(UPDATE, device_type)))


def seconds_per_byte(spec: ModelSpec, repeats: int = 5) -> float:
    """Median seconds per parameter byte of AdamW's step, the gradient norm and zeroing."""
    params = [
        p.detach().clone().requires_grad_()
        for p in {id(p): p for b in spec.blocks for p in b.parameters()}.values()
    ]
    if not params:
        return 0.0
    opt = _adamw(params)
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


def gpu_transient(params: list[dict[int, int]]) -> list[float]:
    """Per block, what AdamW's update on a GPU allocates beyond its state (`params`: per block,
    parameter id -> bytes): nothing where it is fused (the trainer's default there), about a copy
    of the block's parameters where it is foreach."""
    if resolve(UPDATE, "cuda") == "fused":
        return [0.0] * len(params)
    return [float(sum(b.values())) for b in params]


def _step_bytes(owned: list[torch.Tensor]) -> float:
    """What one AdamW step (with clipping, as the trainer runs it) allocates on `owned`'s copies."""
    params = [p.detach().clone().requires_grad_() for p in owned if p.requires_grad]
    if not params:
        return 0.0
    opt = _adamw(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    return float(cpu_peak(prof))
