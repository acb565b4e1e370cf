"""What a replicated stage reduces over: DDP wrapped so the hang watchdog sees its buckets
(`data_parallel`), and the process group a local stage's replicas reduce over (`stage_group`).
`layout.ProcessModel` wraps its stages with them; the cpu probe times `data_parallel` as
training issues it (`measure.gloo_probe`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from brigade import forensics
from brigade.errors import BrigadeError


def data_parallel(module: nn.Module, group, device_ids) -> DistributedDataParallel:
    """DDP whose gradient all-reduces tell the hang watchdog which bucket is in flight.

    Under zb the runner reduces with `GradientReducer` on this DDP's group and bucket cap,
    and records its buckets the same way.
    """
    ddp = DistributedDataParallel(module, process_group=group, device_ids=device_ids)
    ddp.register_comm_hook(group, _recorded_allreduce)
    return ddp


def _recorded_allreduce(group, bucket):
    forensics.doing(f"allreduce bucket {bucket.index()}", waiting=True)
    return allreduce_hook(group, bucket)


def stage_group(device: torch.device):
    """A group over the whole world for one local stage, bound to that stage's device.

    A group created without `device_id` inherits the default group's binding; torch refuses
    another. So `dist.init(local_stages=n)` leaves the default group unbound (see there).

    Raises:
        BrigadeError: the default group is bound to one GPU.
    """
    ranks = list(range(dist.get_world_size()))
    if device.type != "cuda":
        return dist.new_group(ranks)
    bound = dist.distributed_c10d._get_default_group().bound_device_id
    if bound is not None:
        raise BrigadeError(f"the process group is bound to {bound} but this process drives several "
                           "GPUs: pass local_stages to brigade.launch.groups.init")
    with torch.cuda.device(device):  # the communicator and its first collective on this GPU
        return dist.new_group(ranks, device_id=device)
