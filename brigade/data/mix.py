"""Weighted mixing of several corpora: `--data web.txt:0.7,code.txt:0.3` trains on one dataset
whose examples are 70 % web.txt's windows and 30 % code.txt's.

    --data a.txt:0.7,b.txt:0.3      two corpora, by weight (any positive numbers: divided by
                                    their sum); each corpus as --data takes one alone

A cycle of `CYCLE` examples holds round(w_k / Σw · CYCLE) of corpus k's (largest remainders, so
the counts fill the cycle), interleaved so that each corpus's share of every prefix of the cycle
stays within one example of its weight (the error-minimising order of Megatron's blended
datasets, computed once, for one cycle). Example i of the mixture is place i % CYCLE of cycle
i // CYCLE: corpus k's example (cycle · count_k + its number among k's places), modulo k's length,
so a corpus smaller than its share repeats within an epoch and a larger one is read in part.
The mixture is Σ len_k examples long, and a pure function of the index: the sampler's global
cursor, all the state a run keeps (`data.sampler`), resumes it exactly, under any layout.

Each corpus keeps its own last --val-fraction for validation, mixed by the same weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from brigade.errors import BrigadeError

CYCLE = 1000  # examples in one turn of the corpora: the weights are kept to 1/CYCLE


def parse(spec: str, flag: str = "--data") -> list[tuple[str, float]] | None:
    """`a:0.7,b:0.3` as [(a, 0.7), (b, 0.3)]; None for one path without a weight (plain --data).

    Raises:
        BrigadeError: a corpus without a weight beside others, a weight that is not a number ≥ 0,
            weights that sum to 0, or a path that is not there.
    """
    items = [item.strip() for item in spec.split(",")] if spec else []
    weighted = [item.rpartition(":") for item in items]
    if len(items) <= 1 and not (weighted and _number(weighted[0][2]) is not None and weighted[0][0]):
        return None
    pairs = []
    for item, (path, _, weight) in zip(items, weighted):
        value = _number(weight) if path else None
        if value is None:
            raise BrigadeError(f"{flag} {spec}: {item!r} has no weight: give each corpus one, as "
                               "path:weight (--data a.txt:0.7,b.txt:0.3)")
        if value < 0:
            raise BrigadeError(f"{flag} {spec}: {path!r} has weight {weight}: weights are numbers ≥ 0")
        if not Path(path).exists():
            raise BrigadeError(f"{flag} {spec}: corpus {path!r} (weight {weight}) not found: give the path "
                               "of a text, corpus or shard set, or leave it out of the mixture")
        pairs.append((path, value))
    if sum(w for _, w in pairs) <= 0:
        raise BrigadeError(f"{flag} {spec}: the weights sum to 0: give at least one corpus a weight above 0")
    return pairs


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def counts(weights: list[float], cycle: int = CYCLE) -> list[int]:
    """Examples of each corpus in one cycle: the weights' shares of `cycle`, rounded by largest
    remainders so that they sum to `cycle`."""
    total = sum(weights)
    exact = [w / total * cycle for w in weights]
    got = [int(e) for e in exact]
    for k in sorted(range(len(weights)), key=lambda k: (got[k] - exact[k], k))[: cycle - sum(got)]:
        got[k] += 1
    return got


def interleave(per: list[int]) -> list[int]:
    """One cycle's corpus at each place: at each, the corpus furthest behind its share so far
    (ties to the first), so every prefix keeps each corpus within one example of its share."""
    cycle, taken, order = sum(per), [0] * len(per), []
    for i in range(cycle):
        k = max(range(len(per)), key=lambda q: (per[q] * (i + 1) / cycle - taken[q], -q))
        taken[k] += 1
        order.append(k)
    return order


class Mixture:
    """The corpora's datasets (`text.CharDataset`, `shards.TokenWindows`) as one, by weight
    (module docstring): `len`, and `batch(indices) -> (inputs, targets)` as each part has."""

    def __init__(self, parts: list, weights: list[float]):
        self.parts, self.per = parts, counts(weights)
        order = interleave(self.per)
        self.order = torch.tensor(order)
        seen, nth = [0] * len(parts), []  # each place's number among its corpus's places
        for k in order:
            nth.append(seen[k])
            seen[k] += 1
        self.nth = torch.tensor(nth)
        self.n = sum(len(p) for p in parts)

    def __len__(self) -> int:
        return self.n

    def locate(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(corpus, example of that corpus) of each of the mixture's examples `indices`."""
        cycle, place = indices // CYCLE, indices % CYCLE
        corpus = self.order[place]
        per = torch.tensor(self.per)[corpus]
        sizes = torch.tensor([len(p) for p in self.parts])[corpus]
        return corpus, (cycle * per + self.nth[place]) % sizes

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The parts' batches, each a tuple of tensors of one arity (inputs, targets, and the
        documents where the parts give them), row by row as the mixture orders them."""
        corpus, example = self.locate(indices.to(torch.int64))
        rows: list[tuple | None] = [None] * len(indices)
        for k in corpus.unique().tolist():
            where = (corpus == k).nonzero().flatten()
            got = self.parts[k].batch(example[where])
            for row, i in enumerate(where.tolist()):
                rows[i] = tuple(t[row] for t in got)
        return tuple(torch.stack(column) for column in zip(*rows))
