"""A model's sample batch as the planner runs its blocks: one block at a time, on the batch's first
rows, whatever shape the batch has.

The trainer hands a pipeline a batch that may be a tensor or a structure, and blocks that may take
side inputs (`pipeline.stages.side_inputs`: `examples/llama.py`'s decoders take the padding mask
by keyword). The planner measures and counts each block apart, so it needs the same two things the
pipeline's feed gives a stage, without a pipeline:

    batch ─ first n rows of every batched tensor (`take`)
          ─ split_named ─► main input   (block 0's input)
                           side inputs  bound to the blocks that declare them (`Bound`)

so that `block(h)` runs every block as the pipeline runs it, and `h[:n]`-style slicing is never
written against a batch that is not one tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from brigade.pipeline.batches import microbatch
from brigade.pipeline.stages import side_inputs, structure


class Bound(nn.Module):
    """A block called with its side inputs: `Bound(block, side)(h) == block(h, **side)`. Holds the
    block itself (its parameters are the block's, not copies)."""

    def __init__(self, block: nn.Module, side: dict[str, Any]):
        super().__init__()
        self.block, self.side = block, side

    def forward(self, h):
        return self.block(h, **self.side)


def take(obj: Any, n: int) -> Any:
    """The first `n` rows of every batched tensor of a tensor or structure; 0-d tensors and
    `brigade.unbatched` ones whole (unwrapped), as a micro-batch gets them
    (`microbatch.split_structure`)."""
    if isinstance(obj, torch.Tensor):
        return obj[:n] if obj.dim() else obj
    leaves, spec = structure.flatten(obj, "input", lambda t: isinstance(t, microbatch.unbatched))
    return structure.unflatten([t.tensor if isinstance(t, microbatch.unbatched) else t[:n] if t.dim() else t
                                for t in leaves], spec)


def runnable(blocks: list[nn.Module], inputs: Any) -> tuple[Any, list[nn.Module]]:
    """(the main input, each block as `block(h)` runs it) for a batch's `inputs`: a block that
    declares side inputs is `Bound` to them; the others are returned as they are.

    Raises:
        BrigadeError: the batch lacks a declared side input, or its main input is ambiguous
            (`side_inputs.split_named`).
    """
    wanted = {name: f"block {i} ({type(b).__name__})"
              for i, b in enumerate(blocks) for name in side_inputs.declared(b, i)}
    main, side = side_inputs.split_named(inputs, wanted)
    out = []
    for i, block in enumerate(blocks):
        names = side_inputs.declared(block, i)
        out.append(Bound(block, {name: side[name] for name in names}) if names else block)
    return main, out


def tokens_per_sample(spec) -> int:
    """Tokens in one sample of `spec`'s batches: the length of its main input where that is a
    sequence of token ids (B, T) of integers (a language model's); 1 otherwise (images, features:
    tokens/s is then samples/s). Read from a batch of one, on the meta device where built there."""
    x, _ = spec.make_batch(1, torch.Generator().manual_seed(0))
    main, _ = runnable(spec.blocks, x)
    ids = isinstance(main, torch.Tensor) and main.dim() == 2 and not main.is_floating_point()
    return int(main.shape[1]) if ids else 1
