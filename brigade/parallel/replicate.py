"""Replicated data parallel: a stage under DDP, wrapped so the hang watchdog sees its buckets.

The stage assembler (`parallel.assemble`) wraps a stage with it where the stage has replicas and
is not sharded; the group is the world's data-parallel group (`world.World.group("dp")`), or a
local stage's own (`World.stage_group`). The cpu probe times `data_parallel` as training issues
it (`measure.gloo_probe`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from brigade import forensics


def data_parallel(module: nn.Module, group, device_ids, ignore: list[str] = ()) -> DistributedDataParallel:
    """DDP whose gradient all-reduces tell the hang watchdog which bucket is in flight.

    Under zb the runner reduces with `GradientReducer` on this DDP's group and bucket cap,
    and records its buckets the same way. `ignore`: names of parameters DDP leaves alone (an
    expert group's experts, `parallel.experts`: reduced over other processes).
    """
    if ignore:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, list(ignore))
    ddp = DistributedDataParallel(module, process_group=group, device_ids=device_ids)
    ddp.register_comm_hook(group, _recorded_allreduce)
    return ddp


def _recorded_allreduce(group, bucket):
    forensics.doing(f"allreduce bucket {bucket.index()}", waiting=True)
    return allreduce_hook(group, bucket)
