"""A world of processes that are not there: this process as rank 0 of a world of `size` (torch's
fake process group: every collective returns at once, its output of the right shape, its contents
whatever the memory held), and its 1-D DeviceMesh. For measuring in one process what one of
several tensor-parallel processes does (`planner.split_costs`, the cpu probe's
`measure.gloo_probe`); the world's other meshes are `world.mesh`'s.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


@contextlib.contextmanager
def fake_world(size: int):
    """A `size`-process world of which this process is rank 0 and the others are not there, and
    its 1-D mesh; None where torch.distributed is already initialized here (or cannot fake one)."""
    if not dist.is_available() or dist.is_initialized():
        yield None
        return
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:  # a torch without it: priced from tp 1's costs
        yield None
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    torch.set_flush_denormal(True)  # a fake collective's output is any memory: no slow denormals
    try:
        yield init_device_mesh("cpu", (size,))
    finally:
        torch.set_flush_denormal(False)
        dist.destroy_process_group()
