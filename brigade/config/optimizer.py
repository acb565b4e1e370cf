"""How AdamW updates the parameters, and which way a device runs fastest.

    --adamw auto       (default) fused where the device has the kernel (CPU and CUDA in every torch
                       brigade supports), foreach otherwise
    --adamw fused      one kernel for every tensor of a group: on this 2-core CPU 4-5x foreach's
                       speed (20 steps of 10.6 M parameters: 209-280 ms against 1,128-1,230 ms)
    --adamw foreach    one kernel per operation over the group's tensors (torch's default on CUDA)
    --adamw for-loop   one tensor at a time (torch's default on the CPU)

The run's first line and its config.toml name the update it resolved to (`resolve`), never
"auto", so a run read back later says what it did. The configuration owns the names; the trainer
(`train.optimizer.adamw`) and the planner's optimizer costs (`planner.optimizer`) ask `resolve`.
torch is imported only when a device is asked about.
"""

from __future__ import annotations

from brigade.errors import BrigadeError

UPDATES = {
    "auto": "fused where the device has the kernel, foreach otherwise",
    "fused": "one kernel for all of a group's tensors",
    "foreach": "one kernel per operation over a group's tensors",
    "for-loop": "one tensor at a time",
}


def fused_devices() -> tuple[str, ...]:
    """The device types torch's fused AdamW runs on, as this torch says (CPU and CUDA at least
    since torch 2.4, the oldest brigade supports)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # a torch that moved it: the two every supported torch has
        return ("cpu", "cuda")
    return tuple(_get_fused_kernels_supported_devices())


def resolve(wanted: str, device_type: str) -> str:
    """The update a run on `device_type` ("cpu", "cuda") uses for --adamw `wanted`.

    Raises:
        BrigadeError: an unknown update, or fused on a device without the kernel.
    """
    if wanted not in UPDATES:  # `config.validate` says so first, for every command
        raise BrigadeError(f"--adamw {wanted!r}: expected one of {', '.join(UPDATES)}")
    if wanted == "auto":
        return "fused" if device_type in fused_devices() else "foreach"
    if wanted == "fused" and device_type not in fused_devices():
        raise BrigadeError(f"--adamw fused: this torch has no fused AdamW for {device_type} devices; "
                           "use --adamw foreach or auto")
    return wanted


def flags(update: str) -> dict[str, bool]:
    """`torch.optim.AdamW`'s keywords for a resolved update."""
    return {"fused": update == "fused", "foreach": update == "foreach"}
