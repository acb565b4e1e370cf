"""The cut `auto` runs best on, measured where a run starts: what a run whose schedule is costed
(auto) and that was given no --balance cuts its blocks by.

The parameter cut (`partition.param_costs`) balances weights, not time, and the solver's cut of
measured time balances each stage, not each rank's pair of stages under the V placement; neither
asks how auto's plan fills and drains. `plans.cuts.choose_cut` does, from per-block costs. Here
each block's forward and backward are timed on one micro-batch (`partition.time_parts`); the two
halves of a split backward (I and W) are not timed apart, so each is taken as half the backward,
as `plans.costs.Costs.measured` takes stage 0's. The plan itself is made again on the stages' real
F, I and W once a step has been traced (`ProcessModel.replan`): only the cut rests on the halves.

Every process of a process group must build the same stages: rank 0 alone measures (the others
wait, so it has the host's cores to itself, as `Costs.cores` assumes) and searches, and the cut
reaches the others by one broadcast.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from brigade.errors import BrigadeError
from brigade.pipeline.plans.cuts import choose_cut
from brigade.pipeline.stages import structure
from brigade.pipeline.stages.partition import _check_stages, param_costs, solve, time_parts

MEASURED = "measured"  # --balance measured: the cut `auto_balance` chooses


def auto_balance(blocks: Sequence[nn.Module], sample: Any, ranks: int, virtual: int, microbatches: int,
                 limit: int = 0, cores: float = 0.0, device: torch.device | None = None,
                 repeats: int = 3) -> list[int]:
    """Blocks per stage (`ranks` × `virtual` entries) for auto, chosen with its plan from the blocks'
    times on `sample` (module docstring); the same on every process of the group.

    Args:
        blocks: the model's blocks, with their memory (copies are timed: no statistics or
            gradients move). Blocks built on the meta device (an `hf:DIR` model before its weights
            are read) cannot run: they get the parameter cut, as without auto.
        sample: one micro-batch of inputs (a tensor or a structure, with its side inputs).
        limit, cores: auto's memory limit (--auto-limit) and the cores its ranks share, as
            `plans.costs.Costs` takes them.
        device: where to time (the process's device; None: where the blocks are): copies of the
            blocks and of the sample go there, since blocks' costs relative to each other differ
            between a CPU and a GPU.

    Raises:
        BrigadeError: more stages than blocks, or a side input missing from the sample.
        PlanError: a memory limit below V. On every process, as rank 0 met it.
    """
    group = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    cut: list[int] | Exception | None = None
    if not group or dist.get_rank() == 0:
        try:  # the timed forwards draw dropout masks: the run's random streams must not move
            gpus = [device] if device is not None and device.type == "cuda" else []
            with torch.random.fork_rng(devices=gpus):
                cut = _chosen(blocks, sample, (ranks, virtual, microbatches), (limit, cores), device, repeats)
        except BrigadeError as exc:  # a PlanError too: every rank says it, none waits for ever
            cut = exc
    if group:
        got = [cut]
        dist.broadcast_object_list(got, src=0)
        cut = got[0]
    if isinstance(cut, Exception):
        raise cut
    return list(cut)


def _chosen(blocks: Sequence[nn.Module], sample: Any, sizes: tuple[int, int, int],
            planned: tuple[int, float], device: torch.device | None, repeats: int) -> list[int]:
    """This process's choice: the solver's cut of the measured times, then `choose_cut` from it.
    `sizes`: (ranks, V, micro-batches); `planned`: (limit, cores)."""
    (ranks, virtual, microbatches), (limit, cores) = sizes, planned
    _check_stages(len(blocks), ranks * virtual)
    if any(p.is_meta for b in blocks for p in b.parameters()):
        return solve(param_costs(blocks), ranks * virtual)
    copies = [b.to(device) for b in copy.deepcopy(list(blocks))] if device else copy.deepcopy(list(blocks))
    if device is not None:
        tensors, spec = structure.flatten(sample, root="sample")
        sample = structure.unflatten([t.to(device) for t in tensors], spec)
    times = time_parts(copies, sample, repeats)
    costs = [(f, b, b / 2, b / 2) for f, b in times]
    solver = solve([f + b for f, b in times], ranks * virtual)
    return list(choose_cut(costs, ranks, microbatches, (virtual,), given=[solver], limit=limit,
                           cores=cores).balance)
