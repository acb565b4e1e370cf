"""Timing helpers: warm-up, repeats, mean and standard deviation, synchronised across ranks; the
interleaved rounds every benchmark compares configurations in; the steps they time (a pipelined
step, an unpipelined one) and a round trip between two ranks (`ping_pong`, which the tuner and the
doctor time).

On a GPU the host only queues kernels: every clock read here is preceded by a device
synchronisation (`now`), so a time covers the work, not its launch.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from brigade.errors import RunError


@dataclass
class Workload:
    """What every benchmark runs and how often it times it: a model (by name), a batch, repeats."""

    model: str = "resnet50"
    model_options: dict = field(default_factory=dict)
    batch_size: int = 32
    repeats: int = 5
    warmup: int = 1
    seed: int = 0
    backend: str = "auto"  # gloo on CPU; nccl only with a GPU per process (see bench.run)


class Steps(Protocol):
    """A pipeline that runs one training step: brigade's `Pipeline` or torch's, in `peers`."""

    def step(self, x: torch.Tensor | None, y: torch.Tensor | None) -> object: ...


@dataclass
class Timing:
    mean_s: float
    std_s: float
    samples: list[float]


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device | None) -> float:
    """`perf_counter()` once everything queued on `device` has run (a no-op wait on CPU)."""
    _sync(device)
    return time.perf_counter()


def measure(fn: Callable[[], object], repeats: int = 5, warmup: int = 2, group=None,
            device: torch.device | None = None, distributed: bool = False) -> Timing:
    """Time `fn` `repeats` times after `warmup` calls, the device synchronised around each.

    Args:
        device: the process's device (synchronised before each clock read; None: the CPU).
        distributed: all ranks start each repeat together (barrier) and a repeat lasts until
            the slowest rank is done (a max-reduce of a tensor on `device`).

    Raises:
        ValueError: `distributed` without a `device`: the reduce must run on the group's device.
    """
    if distributed and device is None:
        raise ValueError("measure(distributed=True) needs device=: the process's device (DistInfo.device)")
    for _ in range(warmup):
        fn()
    samples = [_once(fn, device, distributed, group) for _ in range(repeats)]
    std = statistics.stdev(samples) if len(samples) > 1 else 0.0
    return Timing(statistics.fmean(samples), std, samples)


def _once(fn: Callable[[], object], device: torch.device | None, distributed: bool, group) -> float:
    """Seconds of one call of `fn`; `distributed`: started together, the slowest rank's time."""
    if distributed:
        dist.barrier(group=group)
    start = now(device)
    fn()
    elapsed = now(device) - start
    if distributed:
        t = torch.tensor([elapsed], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        elapsed = t.item()
    return elapsed


def interleaved_rounds(steps: dict[str, Callable[[], object]], rounds: int, warmup: int,
                       device: torch.device, seed: int = 0, group=None) -> dict[str, list[float]]:
    """Time every step once per round, for `rounds` rounds, on every rank together.

    Slow drift of a shared machine (another job starting, the clock throttling) then hits
    every configuration alike instead of whichever happened to be timed during it; the order
    within a round is shuffled with a seed per round, the same on every rank, so no step
    always follows the same neighbour. A round's value of a step is the slowest rank's time.

    Args:
        steps: key -> a step every rank runs (a rank with nothing to do passes a no-op);
            every rank must give the same keys in the same order.
        warmup: untimed calls of every step, in turn, before the first round.

    Returns:
        key -> its `rounds` times in seconds, in round order (round k of every key is one round).

    Raises:
        RunError: the ranks built different lists of steps (their keys are printed).
    """
    keys = list(steps)
    seen: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, keys, group=group)
    if any(other != keys for other in seen):
        raise RunError(f"bench ranks built different configurations: {seen}; expected one list on all")
    for _ in range(warmup):
        for key in keys:
            steps[key]()
    times: dict[str, list[float]] = {key: [] for key in keys}
    for r in range(rounds):
        order = keys[:]
        random.Random(seed * 100_003 + r).shuffle(order)
        for key in order:
            times[key].append(_once(steps[key], device, True, group))
    return times


def pipeline_step(pipe: Steps, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """One pipelined training step, then this stage's gradients zeroed: the step benchmarks time."""
    def step() -> None:
        pipe.step(x, y)
        module.zero_grad(set_to_none=True)
    return step


def train_step(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """Forward, loss, backward, gradients zeroed: one step of an unpipelined model."""
    def step() -> None:
        loss_fn(model(x), y).backward()
        model.zero_grad(set_to_none=True)
    return step


def ping_pong(t: torch.Tensor, peer: int, first: bool, recv: torch.Tensor | None = None) -> None:
    """One round trip with `peer`; the `first` side sends first. Time it, halve it.

    Args:
        t: what this side sends; without `recv` also where it receives (an echo, for timing).
        recv: a buffer of t's shape to receive into, so that each side sends its own data and can
            check what the other sent (the doctor's delivery check).
    """
    into = t if recv is None else recv
    if first:
        dist.send(t, peer)
        dist.recv(into, peer)
    else:
        dist.recv(into, peer)
        dist.send(t, peer)
