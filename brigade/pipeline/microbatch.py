"""Split a batch into micro-batches and merge outputs back.

Sizes differ by at most one (the first chunks take the remainder), so any
m ≤ batch size gives exactly m micro-batches. Each micro-batch's loss is
weighted by its share of the batch, so the summed gradient equals the
gradient of the mean loss over the whole batch.
"""

from __future__ import annotations

import torch

from brigade.errors import BrigadeError


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
