"""How `brigade check` feeds a model whose batch is a structure, or carries side inputs.

A model file's `batch()` may return `({"tokens": ..., "padding_mask": ...}, targets)` with a
block declaring `side_inputs = ("padding_mask",)` (examples/llama.py). The one-device reference
then runs all blocks as one `side.StageModule`, the pipeline's stages are StageModules (the
runtime hands each its side inputs per micro-batch), and batches are cut with
`microbatch.split_structure`. A model of plain tensors runs as before: nn.Sequential stages.

Whether structures pass is a property of the whole chain, not of the batch: a batch of one
tensor may become a dict after block 0 and a tensor again later (`chain` probes every block's
output), so nothing here decides from the batch alone what the blocks pass.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from brigade.pipeline import microbatch, structure
from brigade.pipeline.partition import check_chain
from brigade.pipeline.side import needed


def takes_side_inputs(blocks: list[nn.Module]) -> bool:
    """Whether any block declares a side input."""
    return bool(needed(blocks))


def pieces(x: Any, n: int) -> list[Any]:
    """A batch (tensor or structure) cut into `n` pieces along dim 0, as micro-batching cuts it."""
    return microbatch.split_structure(x, n)


def sample(x: Any) -> Any:
    """Two examples of a batch's inputs (a tensor or a structure, side inputs included) for a time
    profile of the blocks (`partition.time_costs`); the whole batch when it has fewer."""
    if torch.is_tensor(x):
        return x[:2]
    n = microbatch.batch_size_of(x, "input")
    return microbatch.split_structure(x, math.ceil(n / 2))[0]  # the first piece has 2 rows


def chain(blocks: list[nn.Module], x: Any) -> list[structure.Spec]:
    """Run `x` through the blocks once, probing every block's output (`partition.check_chain`);
    returns each block's output description."""
    return check_chain(blocks, x)
