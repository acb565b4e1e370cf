"""Bytes held for backward: what autograd saves during a step (activations), over time, and its peak.

While a `Held` is active (`with held:`), every tensor autograd saves for a backward is counted
by its storage (once, however many tensors view it), parameters and their views aside, from the moment it is
saved until the graph holding it is freed (a backward without retain_graph, or the held output
dropped). Recomputed blocks (`recompute.py`) save their own way: what they keep instead — each
block's input, and after its recompute the tensors it made again — they report here, for as long
as their frame lives.

    forward ── saved t ──► hold(t): storage bytes += (first holder)     peak = max(peak, now)
    graph freed ── the holder dies ──► storage bytes -= (last holder)
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

_here = threading.local()  # per thread, as autograd's saved-tensor hooks are: its Helds, innermost last


def _active() -> list[Held]:
    if not hasattr(_here, "held"):
        _here.held = []
    return _here.held


def current() -> Held | None:
    """The Held counting in this thread now, or None."""
    return _active()[-1] if _active() else None


def is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (a Linear saves its weight transposed): held anyway."""
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


def storage_of(t: torch.Tensor):
    """`t`'s storage. A DTensor (tensor parallel saves some) has none of its own: its local part's
    counts (the attribute, not to_local(): no autograd op inside a saved-tensor hook). A wrapper
    tensor (torchao's float8 weights under FSDP2) neither: the first inner tensor's counts."""
    t = t._local_tensor if isinstance(t, DTensor) else t
    while is_traceable_wrapper_subclass(t):
        t = getattr(t, t.__tensor_flatten__()[0][0])
    return t.untyped_storage()


def storage_key(t: torch.Tensor) -> tuple | None:
    """(device, address) of `t`'s storage, the same for every view of it; None when it is empty."""
    storage = storage_of(t)
    return (t.device, storage.data_ptr()) if storage.nbytes() else None


class _Holder:
    """A saved tensor while autograd keeps it; counted off when autograd drops it.

    It keeps `t.detach()`: the same storage, without the autograd node that made it. A node that
    saves its own output (attention does) would otherwise hold a holder that holds the output
    that holds the node: a cycle through C++ that nothing collects. A whole backward frees saved
    tensors as it goes and so broke it; a split backward's weight pass never runs the input
    path's nodes, and their graph outlived the step while it was measured."""

    __slots__ = ("t", "held", "key")

    def __init__(self, t: torch.Tensor, held: Held):
        self.t, self.held, self.key = t.detach(), held, held.add(t)

    def __del__(self):
        self.held.remove(self.key)


class Held:
    """Counts the bytes held for backward while active; `peak` is the most at any moment.

    Args:
        exclude: tensors whose storages are not counted (weights that are not nn.Parameters, say).
    """

    def __init__(self, exclude: list[torch.Tensor] = ()):
        self.refs: dict[tuple, list[int]] = {}  # storage → [bytes, holders]
        self.now = self.peak = 0
        self._exclude = {storage_key(t) for t in exclude}
        self._hooks = None

    def add(self, t: torch.Tensor) -> tuple | None:
        key = storage_key(t)
        if key is None or key in self._exclude:
            return None
        entry = self.refs.setdefault(key, [storage_of(t).nbytes(), 0])
        entry[1] += 1
        if entry[1] == 1:
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        return key

    def remove(self, key: tuple | None) -> None:
        entry = self.refs.get(key) if key is not None else None
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.refs[key]

    def keep(self, tensors: list[torch.Tensor]) -> list[_Holder]:
        """Count `tensors` for as long as the returned holders live (a recompute frame keeps them)."""
        return [_Holder(t, self) for t in tensors if not is_parameter(t)]

    def _pack(self, t: torch.Tensor):
        return t if is_parameter(t) else _Holder(t, self)

    @staticmethod
    def _unpack(h):
        return h.t if isinstance(h, _Holder) else h

    def __enter__(self) -> Held:
        self._hooks = contextlib.ExitStack()
        self._hooks.enter_context(saved_tensors_hooks(self._pack, self._unpack))
        _active().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active().remove(self)
        self._hooks.close()
