"""How `brigade check` feeds a model whose batch is a structure, or carries side inputs.

A model file's `batch()` may return `({"tokens": ..., "padding_mask": ...}, targets)` with a
block declaring `side_inputs = ("padding_mask",)` (examples/llama.py). The one-device reference
then runs all blocks as one `side_inputs.StageModule`, the pipeline's stages are StageModules (the
runtime hands each its side inputs per micro-batch), and batches are cut with
`microbatch.split_structure`. A model of plain tensors runs as before: nn.Sequential stages.

Whether structures pass is a property of the whole chain, not of the batch: a batch of one
tensor may become a dict after block 0 and a tensor again later (`chain` probes every block's
output), so nothing here decides from the batch alone what the blocks pass.

Cutting a batch is `microbatch.split_structure`'s, probing the chain `partition.check_chain`'s;
what is left here is the sample a time profile runs on.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from brigade.pipeline.batches import microbatch


def sample(x: Any) -> Any:
    """Two examples of a batch's inputs (a tensor or a structure, side inputs included) for a time
    profile of the blocks (`partition.time_costs`); the whole batch when it has fewer."""
    if torch.is_tensor(x):
        return x[:2]
    n = microbatch.batch_size_of(x, "input")
    return microbatch.split_structure(x, math.ceil(n / 2))[0]  # the first piece has 2 rows
