"""Timing helpers: warm-up, repeats, mean and standard deviation, synchronised across ranks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Timing:
    mean_s: float
    std_s: float
    samples: list[float]


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], object], repeats: int = 5, warmup: int = 2, group=None,
            device: torch.device | None = None, distributed: bool = False) -> Timing:
    """Time `fn` `repeats` times after `warmup` calls. With `distributed`, all ranks start each
    repeat together (barrier) and a repeat lasts until the slowest rank is done (max-reduce)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if distributed:
            dist.barrier(group=group)
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        elapsed = time.perf_counter() - start
        if distributed:
            t = torch.tensor([elapsed], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            elapsed = t.item()
        samples.append(elapsed)
    std = statistics.stdev(samples) if len(samples) > 1 else 0.0
    return Timing(statistics.fmean(samples), std, samples)


def stage_costs(module: torch.nn.Module, x: torch.Tensor, loss_fn=None, target=None,
                repeats: int = 5) -> tuple[float, float]:
    """Median forward and backward seconds of one stage on one micro-batch `x`, no communication."""
    fwd, bwd = [], []
    for _ in range(repeats + 1):
        inp = x.detach().requires_grad_(x.is_floating_point())
        t0 = time.perf_counter()
        y = module(inp)
        if loss_fn is not None:
            y = loss_fn(y, target)
        t1 = time.perf_counter()
        y.backward(None if loss_fn is not None else torch.ones_like(y))
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    module.zero_grad(set_to_none=True)
    return statistics.median(fwd[1:]), statistics.median(bwd[1:])
