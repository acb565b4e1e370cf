"""Side inputs: parts of a batch that later blocks take from the data, not through the pipeline.

A block declares what it takes with a class (or instance) attribute and receives it by keyword:

    class Decoder(nn.Module):
        side_inputs = ("padding_mask",)
        def forward(self, x, *, padding_mask): ...

`batch(n, generator)` then returns `({"tokens": ..., "padding_mask": ...}, targets)`:
`split_inputs` takes the declared keys out as side inputs, and the rest is the main input that
flows through the blocks. A stage runs as a `StageModule`, which hands each block its side
inputs and says which two blocks disagree when one cannot take the other's output.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from brigade.errors import BrigadeError
from brigade.pipeline.stages import structure

ATTRIBUTE = "side_inputs"
# What a block raises when handed a structure it does not take (wrong arity, shapes, keys).
MISMATCH = (TypeError, ValueError, IndexError, KeyError, AttributeError, RuntimeError)


def _name(block: nn.Module, index: int) -> str:
    return f"block {index} ({type(block).__name__})"


def declared(block: nn.Module, index: int = 0) -> tuple[str, ...]:
    """The side inputs a block declares (its `side_inputs` attribute), checked against its forward.

    Raises:
        BrigadeError: the attribute is not a tuple of str, or forward takes no such keyword.
    """
    names = getattr(block, ATTRIBUTE, ())
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise BrigadeError(f"{_name(block, index)}.side_inputs = {names!r}: expected a tuple of names, "
                           f"e.g. ({str(names)!r},)")
    if names:
        params = inspect.signature(block.forward).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        missing = [n for n in names if not takes_any and (
            n not in params or params[n].kind is inspect.Parameter.POSITIONAL_ONLY)]
        if missing:
            raise BrigadeError(f"{_name(block, index)} declares side input {missing[0]!r} but its forward "
                               f"does not take it by keyword: write forward(self, x, *, {missing[0]})")
    return tuple(names)


def needed(blocks: Sequence[nn.Module], first_index: int = 0) -> dict[str, int]:
    """Every side input the blocks declare → the index of the first block that takes it."""
    out: dict[str, int] = {}
    for i, block in enumerate(blocks, start=first_index):
        for name in declared(block, i):
            out.setdefault(name, i)
    return out


def split_inputs(inputs: Any, blocks: Sequence[nn.Module]) -> tuple[Any, dict[str, Any]]:
    """Separate a batch's inputs into the main input and the side inputs the model's blocks declare.

    Args:
        inputs: what `batch()` returned first: a tensor or structure, or a dict of named inputs.
        blocks: all of the model's blocks, in order.

    Returns:
        (main, side): the main input (a dict's single undeclared value; the dict itself when no
        block declares anything) and {name: value} for every declared side input.

    Raises:
        BrigadeError: a declared side input missing from the batch, inputs that are not a dict
            while blocks declare side inputs, no main input left, or several undeclared keys
            beside declared ones (which of them is the main input is ambiguous).
    """
    return split_named(inputs, {name: _name(blocks[i], i) for name, i in needed(blocks).items()})


def split_named(inputs: Any, wanted: Mapping[str, str]) -> tuple[Any, dict[str, Any]]:
    """`split_inputs` from the declarations alone: {side input name: the block that takes it,
    as messages name it}, for a rank that does not hold every block.

    Raises:
        BrigadeError: as `split_inputs`.
    """
    if not wanted:
        return inputs, {}
    first, label = next(iter(wanted.items()))
    if not isinstance(inputs, Mapping):
        raise BrigadeError(
            f"{label} declares side input {first!r} but batch() returned "
            f"{structure.describe(inputs)} as inputs: return ({{'input': ..., {first!r}: ...}}, targets)")
    for name, label in wanted.items():
        if name not in inputs:
            raise BrigadeError(f"{label} declares side input {name!r} but the batch has only "
                               f"{sorted(inputs)}: add {name!r} to the inputs batch() returns")
    rest = [k for k in inputs if k not in wanted]
    if not rest:
        raise BrigadeError(f"every input of the batch ({sorted(inputs)}) is a side input: keep the first "
                           "block's input under a key no block declares")
    if len(rest) > 1:
        raise BrigadeError(
            f"the batch's inputs {rest} are declared by no block, so the main input is ambiguous: "
            "declare side inputs with side_inputs = (...) on the blocks that take them, or nest the "
            "main input under one key")
    return inputs[rest[0]], {name: inputs[name] for name in wanted}


class StageModule(nn.Module):
    """A stage's blocks run in order, each given its declared side inputs by keyword.

    Replaces nn.Sequential for a stage. Blocks are held under their model-wide indices ("3",
    "4", ...). Each block's output is checked to be sendable, and a block that fails on the
    previous one's output is reported naming both blocks and the stage.

    Args:
        blocks: the stage's blocks, in order.
        indices: their indices in the model (default 0, 1, ...).
        stage: the stage number, for messages.
        check: check every block's output is a structure that can be sent.

    Raises:
        BrigadeError: a malformed `side_inputs` declaration (see `declared`).
    """

    def __init__(self, blocks: Sequence[nn.Module], indices: Sequence[int] | None = None,
                 stage: int = 0, check: bool = True):
        super().__init__()
        indices = list(range(len(blocks))) if indices is None else list(indices)
        if len(indices) != len(blocks):
            raise BrigadeError(f"StageModule: {len(indices)} indices for {len(blocks)} blocks: give one each")
        self.indices, self.stage, self.check = indices, stage, check
        self.wants = []
        for i, block in zip(indices, blocks):
            self.add_module(str(i), block)
            self.wants.append(declared(block, i))

    @property
    def side_inputs(self) -> tuple[str, ...]:
        """The side inputs this stage's blocks take, for the runtime to deliver."""
        return tuple(dict.fromkeys(n for names in self.wants for n in names))

    def blocks(self) -> list[nn.Module]:
        """The blocks, in order."""
        return list(self._modules.values())

    def forward(self, x: Any, side: Mapping[str, Any] | None = None) -> Any:
        """Run the blocks on `x`; `side` maps side-input names to this micro-batch's values.

        Raises:
            BrigadeError: a side input a block declares is missing from `side`, a block's output
                cannot be sent, or a block fails on the previous block's output.
        """
        side = side or {}
        for k, (i, block) in enumerate(zip(self.indices, self.blocks())):
            kwargs = {}
            for name in self.wants[k]:
                if name not in side:
                    raise BrigadeError(f"stage {self.stage}: {_name(block, i)} needs side input {name!r}, "
                                       f"which was not delivered (got {sorted(side)})")
                kwargs[name] = side[name]
            x = self._call(k, block, x, kwargs)
            if self.check:
                structure.flatten(x, root=f"stage {self.stage}: {_name(block, i)}'s output")
        return x

    def _call(self, k: int, block: nn.Module, x: Any, kwargs: dict) -> Any:
        try:
            return block(x, **kwargs)
        except BrigadeError:
            raise
        except torch.OutOfMemoryError:
            raise
        except MISMATCH as exc:
            i = self.indices[k]
            source = (f"{_name(self.blocks()[k - 1], self.indices[k - 1])}'s output" if k
                      else "the batch's input" if i == 0 else f"block {i - 1}'s output (previous stage)")
            first_line = (str(exc).strip().splitlines() or [""])[0]
            raise structure.StructureError(
                f"stage {self.stage}: {_name(block, i)} failed on {source}, "
                f"{structure.describe(x)}: {type(exc).__name__}: {first_line} — make the blocks "
                "agree on what passes between them") from exc


def whole(blocks: list[nn.Module]) -> nn.Module:
    """The blocks as one module that takes a whole batch's inputs (the reference's model)."""
    if not needed(blocks):
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
