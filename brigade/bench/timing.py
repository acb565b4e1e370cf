"""Timing helpers: warm-up, repeats, mean and standard deviation, synchronised across ranks.

On a GPU the host only queues kernels: every clock read here is preceded by a device
synchronisation (`now`), so a time covers the work, not its launch.
"""

from __future__ import annotations

import copy
import math
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


def median_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """The median of `values` and a distribution-free confidence interval for it.

    Order-statistic (binomial) interval: sorted x(1) ≤ … ≤ x(n), the interval is
    [x(k), x(n+1-k)] for the largest k with 2·P(Binomial(n, ½) < k) ≤ 1 − confidence; it
    assumes only that the values are independent draws (one per round), not their shape.
    Below 6 values no k reaches 95 %: the interval is then [min, max] (coverage 1 − 2^(1−n)).

    Returns:
        (median, low, high).

    Raises:
        ValueError: no values.
    """
    if not values:
        raise ValueError("median_ci of no values: time at least one round")
    xs, n = sorted(values), len(values)
    k = _order(n, confidence)
    return statistics.median(xs), xs[k - 1], xs[n - k]


def _tail(n: int, j: int) -> float:
    """P(Binomial(n, 1/2) <= j)."""
    return sum(math.comb(n, i) for i in range(j + 1)) / 2**n


def _order(n: int, confidence: float) -> int:
    """The k of `median_ci`'s interval [x(k), x(n+1-k)]."""
    k = 1
    while k + 1 <= (n + 1) // 2 and 2 * _tail(n, k) <= 1 - confidence:
        k += 1
    return k


def median_ci_coverage(n: int, confidence: float = 0.95) -> float:
    """The coverage `median_ci` really has with n values: at least `confidence` from 6 values on."""
    return 1 - 2 * _tail(n, _order(n, confidence) - 1)


def ratio_ci(numerators: list[float], denominators: list[float],
             confidence: float = 0.95) -> tuple[float, float, float]:
    """`median_ci` of the per-round ratios numerator / denominator (the lists pair by round)."""
    return median_ci([a / b for a, b in zip(numerators, denominators, strict=True)], confidence)


def pipeline_step(pipe: Steps, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """One pipelined training step, then this stage's gradients zeroed: the step benchmarks time."""
    def step() -> None:
        pipe.step(x, y)
        module.zero_grad(set_to_none=True)
    return step


def time_pipeline(pipe: Steps, module: nn.Module, x: torch.Tensor, y: torch.Tensor,
                  work: Workload) -> Timing:
    """`pipeline_step` timed on every rank together (`measure(distributed=True)` on x's device)."""
    return measure(pipeline_step(pipe, module, x, y), work.repeats, work.warmup, device=x.device,
                   distributed=True)


def train_step(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """Forward, loss, backward, gradients zeroed: one step of an unpipelined model."""
    def step() -> None:
        loss_fn(model(x), y).backward()
        model.zero_grad(set_to_none=True)
    return step


def time_single(blocks: list[nn.Module], loss_fn, x: torch.Tensor, y: torch.Tensor,
                work: Workload) -> Timing:
    """A copy of the whole model on x's device, on the whole batch, in this process alone."""
    full = nn.Sequential(*copy.deepcopy(blocks))
    return measure(train_step(full, loss_fn, x, y), work.repeats, work.warmup, device=x.device)


def stage_costs(module: torch.nn.Module, x: torch.Tensor, loss_fn=None, target=None,
                first: bool = False, repeats: int = 10) -> tuple[float, float, float, float]:
    """Median forward, backward, weight-gradient and input-gradient seconds of one stage on one
    micro-batch.

    The last two are the W and I halves of a split backward (see pipeline.backward), each timed:
    together they cost more than one backward. No communication is included. The module and `x`
    share a device, synchronised before every clock read.
    """
    from brigade.pipeline.runtime.backward import backward_split

    device = x.device
    fwd, bwd, wgt, ing = [], [], [], []
    for k in range(2 * (repeats + 2)):
        inp = x.detach().requires_grad_(x.is_floating_point() and not first)
        t0 = now(device)
        y = module(inp)
        if loss_fn is not None:
            y = loss_fn(y, target)
        t1 = now(device)
        grad = None if loss_fn is not None else torch.ones_like(y)
        if k % 2 == 0:
            torch.autograd.backward(y, grad)
            bwd.append(now(device) - t1)
            fwd.append(t1 - t0)
        else:
            _, weight_step = backward_split(y, grad, None if first else inp, list(module.parameters()))
            t2 = now(device)
            weight_step()
            wgt.append(now(device) - t2)
            ing.append(t2 - t1)
    module.zero_grad(set_to_none=True)
    return tuple(statistics.median(got[2:]) for got in (fwd, bwd, wgt, ing))


def gathered_stage_costs(stages: list[torch.nn.Module], rank: int, x: torch.Tensor, y: torch.Tensor,
                         loss_fn, m: int, repeats: int = 10,
                         held: list[int] | None = None, turns: bool = False) -> tuple[list[float], ...]:
    """Every stage's (forward, backward, weight, input) seconds on the first of `m` micro-batches.

    Each rank measures its own stages on the input each sees, at the same time as the others
    (as in a real step, every core busy); the results are gathered on every rank, through
    tensors on `x`'s device (the process's: stages and batch live there).

    Args:
        held: the stages this rank measures (default: stage `rank`, one per rank); the ranks'
            lists together must hold every stage once.
        turns: the ranks measure one at a time instead, each with the host to itself. Where
            ranks outnumber cores, all at once is biased: each rank's timings depend on how many
            others are still measuring (ResNet-50 at pp 4 on 2 cores read I + W at 0.66–0.97 of
            B; alone, 1.04–1.35), and a plan weighed on shared cores (`Costs.cores`) wants the
            costs of a rank alone.
    """
    n = len(stages)
    table = torch.zeros(n, 4, dtype=torch.float64, device=x.device)
    mine = [rank] if held is None else held
    for turn in range(dist.get_world_size()) if turns else [rank]:
        if turn == rank:
            _measure_stages(stages, mine, table, x, y, loss_fn, m, repeats)
        if turns:
            dist.barrier()
    dist.all_reduce(table)  # each stage measured by one rank: the sum is the gather
    return tuple(table[:, k].tolist() for k in range(4))


def _measure_stages(stages, mine: list[int], table: torch.Tensor, x, y, loss_fn, m: int,
                    repeats: int) -> None:
    """Time stages `mine` into `table`'s rows (`gathered_stage_costs`)."""
    from brigade.pipeline.batches import microbatch

    n = len(stages)
    for s in mine:
        inp = microbatch.split(x, m)[0]
        with torch.no_grad():
            for before in stages[:s]:
                inp = before(inp)
        last = s == n - 1
        target = microbatch.split(y, m)[0] if last else None
        costs = stage_costs(stages[s], inp, loss_fn if last else None, target, first=s == 0, repeats=repeats)
        table[s] = torch.tensor(costs, dtype=torch.float64, device=x.device)


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
