"""What each stage (or block) of a model costs on one micro-batch: forward, backward and a split
backward's weight and input halves, each timed through the synchronised clock (`timing.now`).

    stage_costs            one stage's medians, in this process
    gathered_stage_costs   every stage's, each rank measuring its own, gathered on every rank
                           (the benches' ideal step is `simulate()` over them)
    block_costs            every block's, one after another (the costs the tuner and the planner
                           interpolate between micro-batch sizes)
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
from torch import nn

from brigade.measure.timing import now


def stage_costs(module: torch.nn.Module, x: torch.Tensor, loss_fn=None, target=None,
                first: bool = False, repeats: int = 10) -> tuple[float, float, float, float]:
    """Median forward, backward, weight-gradient and input-gradient seconds of one stage on one
    micro-batch.

    The last two are the W and I halves of a split backward (see pipeline.runtime.backward), each timed:
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


def block_costs(blocks: list[nn.Module], x: torch.Tensor, loss_fn, y,
                repeats: int = 3) -> list[tuple[float, ...]]:
    """(forward, backward, weight, input) seconds of every block on input batch x (on x's device),
    each the median of `repeats` timings."""
    out = []
    h = x
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        out.append(stage_costs(block, h, loss_fn if last else None, y if last else None,
                               first=i == 0, repeats=repeats))
        with torch.no_grad():
            h = block(h)
    return out
