"""How `brigade check` feeds a model whose batch is a structure, or carries side inputs.

A model file's `batch()` may return `({"tokens": ..., "padding_mask": ...}, targets)` with a
block declaring `side_inputs = ("padding_mask",)` (examples/llama.py). The one-device reference
then runs all blocks as one `side.StageModule`, the pipeline's stages are StageModules (the
runtime hands each its side inputs per micro-batch), and batches are cut with
`microbatch.split_structure`. A model of plain tensors runs as before: nn.Sequential stages.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from brigade.pipeline import microbatch
from brigade.pipeline.partition import check_chain
from brigade.pipeline.side import needed


def takes_side_inputs(blocks: list[nn.Module]) -> bool:
    """Whether any block declares a side input."""
    return bool(needed(blocks))


def pieces(x: Any, n: int) -> list[Any]:
    """A batch (tensor or structure) cut into `n` pieces along dim 0, as micro-batching cuts it."""
    return microbatch.split(x, n) if torch.is_tensor(x) else microbatch.split_structure(x, n)


def sample(x: Any) -> torch.Tensor | None:
    """Two examples for a time profile of the blocks; None for a structured batch (no profile)."""
    return x[:2] if torch.is_tensor(x) else None


def chain(blocks: list[nn.Module], x: Any) -> None:
    """Run `x` through the blocks once (`partition.check_chain`, which takes structures too)."""
    check_chain(blocks, x)
