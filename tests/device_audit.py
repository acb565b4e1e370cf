"""A strict stand-in for NCCL's rule, for CPU test runs: a collective or point-to-point
tensor must live on the device its process group is declared for.

On a GPU every group of a brigade process is declared for CUDA, and a tensor that nobody
placed — created without `device=` and so on the CPU — fails there (or hangs). On CPU such
a tensor works, so the defect hides. This module tags every tensor a factory (`torch.tensor`,
`torch.zeros`, …) makes without a `device=` argument, carries the tag through arithmetic,
drops it when the tensor is moved with `.to(device)`, and makes every torch.distributed
send, receive and collective refuse a tagged tensor.

Installed in every process of a command by `install()` from a `sitecustomize` module that the
test puts on PYTHONPATH (see tests/test_device_audit.py).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

FACTORIES = {torch.tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.rand,
             torch.randn, torch.randint, torch.as_tensor, torch.scalar_tensor}
MOVES = {torch.Tensor.to, torch.Tensor.cuda}
CALLS = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
         "reduce", "send", "recv", "isend", "irecv", "gather", "scatter")


class NoDeviceChosen(RuntimeError):
    """A tensor created without a device reached a collective or a point-to-point transfer."""


def _tagged(value) -> bool:
    if isinstance(value, torch.Tensor):
        return getattr(value, "_no_device_chosen", False)
    if isinstance(value, (list, tuple)):
        return any(_tagged(v) for v in value)
    return False


def _tag(value) -> None:
    if isinstance(value, torch.Tensor):
        value._no_device_chosen = True
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tag(v)


class DeviceAudit(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in FACTORIES:
            if kwargs.get("device") is None:
                _tag(out)
        elif func in MOVES:
            if _explicit_device(args, kwargs):  # placed now, even when .to() returned the same tensor
                if isinstance(out, torch.Tensor):
                    out._no_device_chosen = False
            elif _tagged(args[0]):  # .to(dtype): still where nobody chose
                _tag(out)
        elif _tagged(list(args)) or _tagged(list(kwargs.values())):
            _tag(out)
        return out


def _explicit_device(args, kwargs) -> bool:
    if "device" in kwargs:
        return True
    return any(isinstance(a, (torch.device, str)) or (isinstance(a, torch.Tensor) and a is not args[0])
               for a in args[1:])


def _guard(name: str, fn):
    @functools.wraps(fn)
    def checked(*args, **kwargs):
        if _tagged(list(args)) or _tagged(list(kwargs.values())):
            raise NoDeviceChosen(f"torch.distributed.{name} got a tensor created without a device: "
                                 "under NCCL it must be on the group's GPU")
        return fn(*args, **kwargs)
    return checked


def _guard_batch(fn):
    @functools.wraps(fn)
    def checked(ops):
        if any(_tagged(op.tensor) for op in ops):
            raise NoDeviceChosen("torch.distributed.batch_isend_irecv got a tensor created without a "
                                 "device: under NCCL it must be on the group's GPU")
        return fn(ops)
    return checked


def install() -> None:
    """Audit this process: from now on every collective checks its tensors."""
    from torch.distributed import distributed_c10d as c10d

    # Patched in both namespaces with the same object: `P2POp` and `batch_isend_irecv` compare
    # `op is isend` against distributed_c10d's own names.
    for name in CALLS:
        if hasattr(c10d, name):
            checked = _guard(name, getattr(c10d, name))
            setattr(c10d, name, checked)
            setattr(dist, name, checked)
    dist.batch_isend_irecv = c10d.batch_isend_irecv = _guard_batch(c10d.batch_isend_irecv)
    DeviceAudit().__enter__()
