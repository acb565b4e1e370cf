"""A world of processes that are not there, for measuring in one process what one of several
tensor-parallel processes does (`planner.split_costs`, the cpu probe's `gloo_probe`).

    fake_world     this process as rank 0 of a world of `size` (torch's fake process group:
                   every collective returns at once, its output of the right shape, its contents
                   whatever the memory held), and its 1-D DeviceMesh
    Collectives    how many collectives the code inside it issued (torch's functional ones, as
                   DTensor issues them), counted on a fake world or a real one alike
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

_ISSUED = ("all_", "reduce", "broadcast")  # a collective's ops, not its waits or autograd wrappers


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


class Collectives:
    """Context manager counting the collectives issued inside it (`n`): torch's functional ones,
    which DTensor issues (not their waits, nor the wrappers that carry them through autograd).
    torch's CommDebugMode counts them too, but its module tracker fails on a block recomputed
    in its backward."""

    def __init__(self):
        self.n = 0
        self._mode = None

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace == "_c10d_functional" and func.__name__.startswith(_ISSUED):
                    counter.n += 1
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
