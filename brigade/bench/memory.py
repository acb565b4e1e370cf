"""Peak activation memory of a stage: bytes of tensors autograd keeps for backward, tracked live.

On CPU there is no allocator counter to read, so brigade counts what it can see:
every tensor saved for backward is counted once (by storage) while it is alive.
"""

from __future__ import annotations

import weakref

import torch


class ActivationMeter:
    """Context manager: `peak_bytes` of saved-for-backward tensors alive at once."""

    def __init__(self, exclude=()):
        self.live = 0
        self.peak_bytes = 0
        self._storages: dict[int, int] = {}  # storage pointer -> references held
        self._exclude = {p.untyped_storage().data_ptr() for p in exclude}  # e.g. the weights

    def _pack(self, t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key in self._exclude:
            return t
        if key not in self._storages:
            self._storages[key] = 0
            self.live += t.untyped_storage().nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live)
        self._storages[key] += 1
        holder = _Held(t)
        weakref.finalize(holder, self._release, key, t.untyped_storage().nbytes())
        return holder

    def _release(self, key: int, nbytes: int) -> None:
        self._storages[key] -= 1
        if not self._storages[key]:
            del self._storages[key]
            self.live -= nbytes

    @staticmethod
    def _unpack(holder):
        return holder.tensor if isinstance(holder, _Held) else holder

    def __enter__(self) -> ActivationMeter:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
