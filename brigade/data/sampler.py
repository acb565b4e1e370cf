"""The order a run reads its examples in: per-epoch permutations and one global cursor.

Each epoch is a permutation of all examples drawn from (seed, epoch); global batch n takes the
next `batch_size` indices from the cursor. A data-parallel rank takes its contiguous slice of
the global batch, so the cursor means the same thing whatever dp is, and a run resumes under
another layout (dp, pp, tp, nodes) reading the same samples in the same steps: the cursor is
all the state there is, and the snapshot keeps it.

    global batch 7 (cursor 56..63):  i56 i57 i58 i59 | i60 i61 i62 i63
                                     dp rank 0       | dp rank 1        (dp 2)
                                     dp rank 0                          (dp 1)

Memory: up to `DRAWN` examples the permutation is drawn whole (`torch.randperm`, 8 bytes an
example, once per epoch). Past that it is computed a batch at a time, in no memory: a keyed
Feistel network over the next power of four, walked until it lands inside [0, n) (a bijection
of [0, n), so every example still comes once an epoch), keyed by (seed, epoch). A 1 GB corpus
of tiny-model windows is some 15 M examples: 125 MB per rank drawn whole, nothing this way.
"""

from __future__ import annotations

import hashlib

import torch

DRAWN = 1 << 22  # examples up to which an epoch's permutation is drawn whole (32 MB)
_ROUNDS = 6
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # a 64-bit odd constant, as a signed int64


class Sampler:
    """Global batches from per-epoch permutations; `cursor` is all the state there is."""

    def __init__(self, n_examples: int, batch_size: int, seed: int, cursor: int = 0):
        self.n = n_examples
        self.batch_size = batch_size
        self.seed = seed
        self.cursor = cursor  # examples consumed since the start of training
        self._epoch, self._perm = -1, None

    @property
    def epoch(self) -> int:
        return self.cursor // self.n

    def _generator(self, epoch: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)

    def _permuted(self, epoch: int, positions: torch.Tensor) -> torch.Tensor:
        """The examples at `positions` of epoch `epoch`'s permutation."""
        if self.n > DRAWN:
            keys = torch.randint(0, 1 << 62, (_ROUNDS,), generator=self._generator(epoch))
            return feistel_permute(positions, self.n, keys)
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=self._generator(epoch))
        return self._perm[positions]

    def next_global(self) -> torch.Tensor:
        """The next global batch of example indices; advances the cursor."""
        out = []
        while len(out) < self.batch_size:
            epoch, pos = divmod(self.cursor, self.n)
            take = min(self.batch_size - len(out), self.n - pos)
            out.extend(self._permuted(epoch, torch.arange(pos, pos + take)).tolist())
            self.cursor += take
        return torch.tensor(out)

    @staticmethod
    def shard(indices: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        """This data-parallel rank's contiguous slice of a global batch."""
        per = len(indices) // world
        return indices[rank * per : (rank + 1) * per]


def feistel_permute(positions: torch.Tensor, n: int, keys: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, n) applied to `positions`: a balanced Feistel network over [0, 4^h)
    (4^h ≥ n) with one round key each, applied again to whatever lands at n or past it (cycle
    walking: it stays a bijection of [0, n), and lands inside in under 4 tries on average)."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    x = positions.to(torch.int64).clone()
    outside = torch.ones_like(x, dtype=torch.bool)
    while outside.any():
        left, right = x[outside] >> half, x[outside] & mask
        for key in keys.tolist():
            mixed = (right * _MIX + key) & ((1 << 62) - 1)
            left, right = right, left ^ ((mixed ^ (mixed >> 29)) & mask)
        x[outside] = (left << half) | right
        outside = x >= n
    return x


def fingerprint(indices: torch.Tensor) -> str:
    """A short hash of a global batch's example indices: equal exactly when the same examples, in
    the same order, make the batch (metrics.jsonl's `samples`, compared across layouts)."""
    return hashlib.sha256(indices.to(torch.int64).numpy().tobytes()).hexdigest()[:16]
