"""Where one rank's memory goes during a training step, by kind.

    params       this rank's parameters at rest: its stages' whole parameters (DDP) or its shards
    grads        its gradients once reduced, before the optimizer step (again whole or shards)
    optimizer    the optimizer's state (AdamW: two tensors per parameter, or per shard)
    activations  the most held for backward at any moment of the step (`parallel.held`): saved
                 tensors, and under recompute the block inputs and what a recompute made again
    peak         the most allocated at any moment of the step, everything included (gathered
                 parameters, unsharded gradients, temporaries, communication buffers), plus the
                 parameters, gradients and optimizer state held when it began

Counted from the tensors' storages (each once, however many tensors view it), not from the
process's RSS. `peak` on the CPU comes from the allocator's own events, as torch's profiler
records them (profile_memory); on a GPU from the caching allocator's peak
(`torch.cuda.max_memory_allocated`). Only one step is measured: the profiler slows it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

import torch
from torch.profiler import ProfilerActivity, profile

from brigade.dtensors import local
from brigade.parallel.held import Held, storage_key, storage_of

KINDS = ("params", "grads", "optimizer", "activations")


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages under `tensors` (a DTensor: its local shard's; a float8
    weight wrapper: its inner tensor's, `held.storage_of`)."""
    seen: dict[tuple, int] = {}
    for t in tensors:
        key = None if t is None else storage_key(local(t))
        if key is not None:
            seen[key] = storage_of(local(t)).nbytes()
    return sum(seen.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


def cpu_peak(prof) -> int:
    """The most bytes allocated at once since the profiler started, from its memory events."""
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    now = peak = 0
    for _, nbytes in events:
        now += nbytes
        peak = max(peak, now)
    return peak


class AllocatorPeak:
    """Context manager: `peak_bytes` the CUDA allocator held above its level at entry."""

    method = "allocator"

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_bytes = 0
        self.base = 0  # allocated at entry

    def __enter__(self) -> AllocatorPeak:
        torch.cuda.synchronize(self.device)  # frees of earlier kernels have happened
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize(self.device)
        self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self.base


class StepMemory:
    """Measures one training step of this rank, as a context around it.

    Call `grads_ready(grads)` once the gradients are reduced (before the optimizer step frees
    them); after the step `report()` has the bytes of each kind and the peak.

    Args:
        params: this rank's parameters; optimizer: its optimizer; device: its device.
    """

    def __init__(self, params: list[torch.Tensor], optimizer, device: torch.device):
        self.params, self.optimizer, self.device = params, optimizer, device
        self.held = Held()
        self.grads = 0
        self._prof = self._gpu = None

    def __enter__(self) -> StepMemory:
        self.before = storage_bytes([*self.params, *(p.grad for p in self.params),
                                     *optimizer_tensors(self.optimizer)])
        if self.device.type == "cuda":
            self._gpu = AllocatorPeak(self.device).__enter__()
        else:
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        self.held.__enter__()
        return self

    def grads_ready(self, grads: list[torch.Tensor]) -> None:
        self.grads = storage_bytes(grads)

    def __exit__(self, *exc) -> None:
        self.held.__exit__(*exc)
        if self._prof is not None:
            self._prof.__exit__(*exc)
            self.peak = self.before + cpu_peak(self._prof)
        else:
            self._gpu.__exit__(*exc)
            self.peak = self._gpu.base + self._gpu.peak_bytes

    def report(self) -> dict:
        """{params, grads, optimizer, activations, peak}: bytes (see the module docstring)."""
        return {"params": storage_bytes(self.params), "grads": self.grads,
                "optimizer": storage_bytes(optimizer_tensors(self.optimizer)),
                "activations": self.held.peak, "peak": self.peak,
                "counted": "allocator" if self.device.type == "cuda" else "storages"}


@contextlib.contextmanager
def quiet_stderr():
    """The profiler's C++ start/stop lines go to file descriptor 2: hide them while measuring."""
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
