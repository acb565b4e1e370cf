"""Split a batch into micro-batches and merge outputs back.

Sizes differ by at most one (the first chunks take the remainder), so any
m ≤ batch size gives exactly m micro-batches. Each micro-batch's loss is
weighted by its share of the batch, so the summed gradient equals the
gradient of the mean loss over the whole batch.

Structures (`split_structure`, `merge_structure`): every tensor with a batch dimension is split
along dim 0; 0-d tensors, tensors wrapped in `unbatched` and values go whole to each chunk.
"""

from __future__ import annotations

from typing import Any

import torch

from brigade.errors import BrigadeError
from brigade.pipeline.stages import structure


def check(batch_size: int, n_microbatches: int) -> None:
    """Raise BrigadeError unless 1 ≤ m ≤ batch size."""
    if not 1 <= n_microbatches <= batch_size:
        why = (": need at least 1" if n_microbatches < 1 else
               f" is larger than the batch ({batch_size}): use at most {batch_size} micro-batches "
               "or a larger batch")
        raise BrigadeError(f"microbatches={n_microbatches}{why}")


def split(x: torch.Tensor, n_microbatches: int) -> list[torch.Tensor]:
    """Split along dim 0 into exactly `n_microbatches` chunks."""
    check(x.shape[0], n_microbatches)
    return list(torch.tensor_split(x, n_microbatches, dim=0))


def sizes(batch_size: int, n_microbatches: int) -> list[int]:
    check(batch_size, n_microbatches)
    base, extra = divmod(batch_size, n_microbatches)
    return [base + (1 if i < extra else 0) for i in range(n_microbatches)]


def weights(batch_size: int, n_microbatches: int) -> list[float]:
    """Each micro-batch's share of the batch: the factor on its mean loss."""
    return [n / batch_size for n in sizes(batch_size, n_microbatches)]


def merge(chunks: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(chunks, dim=0)


class unbatched:  # noqa: N801  (used like a function: brigade.unbatched(table))
    """Marks a tensor without a batch dimension (a constant table): every micro-batch gets it whole.

    Args:
        tensor: the tensor to hand to every micro-batch as it is.
    """

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        if not isinstance(tensor, torch.Tensor):
            raise BrigadeError(f"brigade.unbatched({type(tensor).__name__}): expected a tensor; "
                               "values that are not tensors reach every micro-batch anyway")
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"unbatched({structure.describe(self.tensor)})"


def _is_unbatched(x: object) -> bool:
    return isinstance(x, unbatched)


def batch_size_of(obj: Any, root: str = "input") -> int:
    """The batch size of a structure: dim 0 of its first batched tensor (dim ≥ 1, not unbatched).

    Raises:
        BrigadeError: no tensor in it has a batch dimension.
    """
    leaves, _ = structure.flatten(obj, root, _is_unbatched)
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            return t.shape[0]
    raise BrigadeError(f"{root} ({structure.describe(obj)}) has no tensor with a batch dimension: "
                       "give at least one tensor whose dim 0 is the batch")


def split_structure(obj: Any, n_microbatches: int, batch_size: int | None = None,
                    root: str = "input") -> list[Any]:
    """Split every batched tensor of a structure along dim 0 into `n_microbatches` structures.

    Tensors of dim ≥ 1 are split like `split` (sizes as `sizes`); 0-d tensors, tensors wrapped
    in `unbatched` (unwrapped here) and non-tensor values go whole to every micro-batch.

    Args:
        obj: a tensor or a structure (tuple, list, dict, namedtuple) of tensors and values.
        batch_size: the batch size every batched tensor must have; by default the first's.
        root: how error messages name `obj`.

    Returns:
        One structure per micro-batch, shaped like `obj`.

    Raises:
        BrigadeError: a batched tensor whose dim 0 is not the batch size (naming its path),
            an unsendable leaf (`structure.StructureError`), or a bad micro-batch count.
    """
    if isinstance(obj, torch.Tensor) and (batch_size is None or obj.shape[:1] == (batch_size,)):
        return split(obj, n_microbatches)
    batch_size = batch_size_of(obj, root) if batch_size is None else batch_size
    check(batch_size, n_microbatches)
    leaves, spec = structure.flatten(obj, root, _is_unbatched)
    paths = _leaf_paths(spec, root)
    columns = []  # per leaf: its value in each micro-batch
    for t, path in zip(leaves, paths):
        if isinstance(t, unbatched) or t.dim() == 0:
            columns.append([t.tensor if isinstance(t, unbatched) else t] * n_microbatches)
            continue
        if t.shape[0] != batch_size:
            raise BrigadeError(
                f"{path} has {t.shape[0]} rows along dim 0 but the batch has {batch_size}: give it "
                f"the batch dimension, or wrap a constant in brigade.unbatched(...) so every "
                "micro-batch gets it whole")
        columns.append(torch.tensor_split(t, n_microbatches, dim=0))
    return [structure.unflatten([c[i] for c in columns], spec) for i in range(n_microbatches)]


def _leaf_paths(spec: structure.Spec, root: str) -> list[str]:
    """The path of each tensor slot of `spec`, in flatten order, for messages."""
    if spec.kind == "T":
        return [root]
    paths: list[str] = []
    for i, child in enumerate(spec.children):
        key = spec.keys[i] if spec.keys else i
        paths += _leaf_paths(child, f"{root}.{key}" if spec.kind == "namedtuple" else f"{root}[{key!r}]")
    return paths


def merge_structure(chunks: list[Any], root: str = "output") -> Any:
    """Concatenate per-micro-batch structures along dim 0 (the inverse of `split_structure`).

    A tensor that is the same object in every chunk (an unbatched constant passed through) is
    kept once; 0-d tensors are stacked into one value per micro-batch, shape (m,).

    Raises:
        BrigadeError: no chunks, or chunks whose structures differ (naming the first place).
    """
    if not chunks:
        raise BrigadeError(f"merge_structure: no micro-batches to merge for {root}")
    if all(isinstance(c, torch.Tensor) for c in chunks):
        return merge(chunks)
    flat = [structure.flatten(c, root) for c in chunks]
    spec = flat[0][1]
    for i, (_, other) in enumerate(flat[1:], start=1):
        where = structure.first_difference(spec, other, root)
        if where is not None:
            raise BrigadeError(f"micro-batch {i}'s {where} differs from micro-batch 0's: "
                               "a block must return the same structure for every micro-batch")
    merged = [_merge_leaf([f[0][j] for f in flat]) for j in range(spec.n_tensors)]
    return structure.unflatten(merged, spec)


def _merge_leaf(parts: list[torch.Tensor]) -> torch.Tensor:
    if all(p is parts[0] for p in parts):
        return parts[0]
    return torch.stack(parts) if parts[0].dim() == 0 else torch.cat(parts, dim=0)
