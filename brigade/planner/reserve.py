"""What a GPU holds beyond the tensors a step allocates at its peak (`memory.py`'s `peak`): the
reserve a real run's memory reading shows, and what it must fit.

    reserved   allocated, each block of it rounded as PyTorch's CUDA caching allocator rounds
               (PyTorch's CUDA semantics notes: a request over 1 MiB takes 2 MiB steps, so a
               step's largest tensors each leave up to 2 MiB unused: counted as 1 MiB on average
               for each of `TENSORS_LIVE` large tensors), plus the cuBLAS workspace it allocates
               through the allocator (`CUBLAS_WORKSPACE`: ":4096:8", PyTorch's default on Hopper
               and later, 8 × 4 MiB), plus the share the device's profile measured the allocator
               holding beyond that (`DeviceSpec.reserve_frac`, 0: not measured, and not
               counted): what torch.cuda.max_memory_reserved reads, torchtitan's "memory"
    outside    beside it, what NCCL allocates itself for each communicator the layout opens
               (one per parallel dimension over more than one process): NCCL_BUFFSIZE (4 MiB,
               NCCL's default) for each of up to `NCCL_CHANNELS` channels, sent and received
    fits       reserved + outside ≤ the device's memory

On a CPU (a device with `cores`) nothing is added: its allocator is malloc, measured as it is.
"""

from __future__ import annotations

from brigade.planner.devices import DeviceSpec
from brigade.planner.space import Layout

MIB = 2**20
CUBLAS_WORKSPACE = 8 * 4 * MIB
TENSORS_LIVE = 64  # large tensors live at a step's peak, each with half a 2 MiB step unused
NCCL_BUFFSIZE = 4 * MIB
NCCL_CHANNELS = 32


def reserved(peak: float, device: DeviceSpec) -> float:
    """The allocator's reserved bytes at a step's allocated `peak` (module docstring)."""
    if device.cores:
        return peak
    return peak * (1 + device.reserve_frac) + TENSORS_LIVE * MIB + CUBLAS_WORKSPACE


def outside(layout: Layout, device: DeviceSpec) -> float:
    """NCCL's own buffers for the layout's communicators (module docstring); 0 on a CPU."""
    if device.cores:
        return 0.0
    dims = (layout.replicate, layout.shard, layout.pp, layout.tp, layout.ep, layout.cp)
    return sum(1 for n in dims if n > 1) * NCCL_BUFFSIZE * NCCL_CHANNELS * 2
