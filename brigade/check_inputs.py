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
from brigade.pipeline.partition import check_chain, split
from brigade.pipeline.side import StageModule, needed, split_inputs


def takes_side_inputs(blocks: list[nn.Module]) -> bool:
    """Whether any block declares a side input."""
    return bool(needed(blocks))


def whole(blocks: list[nn.Module]) -> nn.Module:
    """The blocks as one module that takes a whole batch's inputs (the reference's model)."""
    if not takes_side_inputs(blocks):
        return nn.Sequential(*blocks)
    return _WithSide(blocks)


class _WithSide(nn.Module):
    """All blocks as one StageModule, the batch's side inputs taken out of its inputs."""

    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.stage = StageModule(blocks, check=False)

    def forward(self, inputs: Any) -> Any:
        main, side = split_inputs(inputs, self.stage.blocks())
        return self.stage(main, side)


def stages_of(blocks: list[nn.Module], balance: list[int]) -> list[nn.Module]:
    """One module per stage: StageModules (blocks under their model-wide indices) when a block
    declares side inputs, else `partition.split`'s nn.Sequentials. Blocks are shared, not copied."""
    if not takes_side_inputs(blocks):
        return split(blocks, balance)
    out, start = [], 0
    for s, n in enumerate(balance):
        out.append(StageModule(blocks[start:start + n], range(start, start + n), stage=s))
        start += n
    return out


def pieces(x: Any, n: int) -> list[Any]:
    """A batch (tensor or structure) cut into `n` pieces along dim 0, as micro-batching cuts it."""
    return microbatch.split(x, n) if torch.is_tensor(x) else microbatch.split_structure(x, n)


def sample(x: Any) -> torch.Tensor | None:
    """Two examples for a time profile of the blocks; None for a structured batch (no profile)."""
    return x[:2] if torch.is_tensor(x) else None


def chain(blocks: list[nn.Module], x: Any) -> None:
    """Run `x` through the blocks once: a block that cannot take the previous one's output is
    named (with its stage, for side-input models) in one line.

    Raises:
        BrigadeError: as `partition.check_chain` or `side.StageModule`.
    """
    if not takes_side_inputs(blocks) and torch.is_tensor(x):
        check_chain(blocks, x)
        return
    with torch.no_grad():
        _WithSide(blocks)(x) if takes_side_inputs(blocks) else nn.Sequential(*blocks)(x)
