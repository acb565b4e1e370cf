"""The precisions a run may name, and the autocast dtype each means.

    --precision ""        (default) follow --bf16: bf16 autocast on GPUs, fp32 on the CPU
    --precision bf16      bf16 autocast on any device (CPU autocast runs it too, slowly)
    --precision fp16      fp16 autocast with loss scaling (`train.precision.LossScaler`), on any device
    --precision fp32      no autocast

The configuration owns the names (its flag's choices, its checks); the trainer asks
`autocast_dtype` for the dtype its pipeline runs the forwards in. torch is imported only when a
dtype is asked for, so reading the names costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from brigade.errors import BrigadeError

if TYPE_CHECKING:
    import torch

PRECISIONS = ("bf16", "fp16", "fp32")
# --float8's recipes (torchao's names; `parallel.float8` applies them): tensorwise, one scale per
# tensor (the fastest kernels); rowwise, one per row (more accurate)
FLOAT8_RECIPES = ("tensorwise", "rowwise")


def check_float8(recipe: str) -> None:
    """Raises BrigadeError, in one line, for a --float8 that is not one of `FLOAT8_RECIPES`."""
    if recipe not in FLOAT8_RECIPES:
        raise BrigadeError(f"--float8 {recipe!r}: expected one of {', '.join(FLOAT8_RECIPES)} "
                           "(tensorwise: fastest; rowwise: more accurate)")


def autocast_dtype(precision: str, bf16: bool, device_type: str) -> torch.dtype | None:
    """The autocast dtype a run uses (None: fp32).

    Args:
        precision: "" (follow `bf16`), "bf16", "fp16" or "fp32".
        bf16: the --bf16 flag, read only when `precision` is empty: bf16 on GPUs.
        device_type: "cuda" or "cpu".

    Raises:
        BrigadeError: an unknown precision.
    """
    import torch

    if precision == "":
        return torch.bfloat16 if bf16 and device_type == "cuda" else None
    if precision not in PRECISIONS:
        raise BrigadeError(f"--precision {precision!r}: expected bf16, fp16 or fp32 "
                           "(or leave it empty to follow --bf16)")
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]
