"""Blocks to stages: explicit balance, by parameters, or by measured time.

A model is an ordered list of blocks. A balance such as ``[3, 5]`` puts the
first 3 blocks on stage 0 and the next 5 on stage 1. Choosing a balance is a
cost vector (one number per block, measured by a profile) plus a pure
min-max solver over integers.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence

import torch
from torch import nn

from brigade.errors import BrigadeError


def parse_balance(text: str) -> list[int]:
    """``"3,5"`` → ``[3, 5]``.

    Raises:
        BrigadeError: if a part is not a whole number.
    """
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise BrigadeError(
            f"--balance {text!r}: expected comma-separated block counts per stage, like 3,5"
        ) from None


def check_balance(balance: Sequence[int], n_blocks: int, n_stages: int | None = None) -> None:
    """Raise BrigadeError unless `balance` splits `n_blocks` into non-empty stages."""
    if n_stages is not None and len(balance) != n_stages:
        raise BrigadeError(
            f"balance {list(balance)} has {len(balance)} stages but {n_stages} were asked for: "
            "give one block count per stage"
        )
    for i, n in enumerate(balance):
        if n < 1:
            raise BrigadeError(
                f"balance {list(balance)}: stage {i} would hold {n} blocks; every stage needs ≥ 1"
            )
    if sum(balance) != n_blocks:
        raise BrigadeError(
            f"balance {list(balance)} sums to {sum(balance)} but the model has {n_blocks} blocks: "
            f"make the counts add up to {n_blocks}"
        )


def _check_stages(n_blocks: int, n_stages: int) -> None:
    if n_stages < 1:
        raise BrigadeError(f"stages={n_stages}: need at least 1 stage")
    if n_stages > n_blocks:
        raise BrigadeError(
            f"stages={n_stages} but the model has only {n_blocks} blocks: "
            f"use at most {n_blocks} stages, or a model with more blocks"
        )


def solve(costs: Sequence[float], n_stages: int) -> list[int]:
    """Contiguous partition of `costs` into `n_stages` non-empty parts minimising the largest sum.

    Exact dynamic programme, O(stages × blocks²). Ties go to the earliest cut.
    """
    n = len(costs)
    _check_stages(n, n_stages)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: min over partitions of the first i blocks into k stages of the largest stage.
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = value, j
    balance, i = [], n
    for k in range(n_stages, 0, -1):
        j = cut[k][i]
        balance.append(i - j)
        i = j
    return balance[::-1]


def param_costs(blocks: Sequence[nn.Module]) -> list[float]:
    """One cost per block: its parameter count (plus 1 so parameter-free blocks weigh something)."""
    return [1.0 + sum(p.numel() for p in b.parameters()) for b in blocks]


@torch.no_grad()
def _clone(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone()


def time_costs(blocks: Sequence[nn.Module], sample: torch.Tensor, repeats: int = 3) -> list[float]:
    """Measured forward+backward seconds per block on `sample` (median of `repeats`).

    Each block runs once untimed first: a first call pays one-off costs (kernel selection,
    allocations, oneDNN primitive creation on CPU) that would make early blocks look heavier
    and push the cut late (ResNet-50 on CPU: the second stage came out ~3× the first).
    """
    costs = []
    x = sample
    for block in blocks:
        times = []
        for k in range(repeats + 1):
            inp = _clone(x)
            if inp.is_floating_point():
                inp.requires_grad_(True)
            if inp.is_cuda:  # the clock starts when the GPU is idle, not while it still copies
                torch.cuda.synchronize(inp.device)
            start = time.perf_counter()
            out = block(inp)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            if out.is_cuda:
                torch.cuda.synchronize(out.device)
            if k:  # the first, warm-up call is not timed
                times.append(time.perf_counter() - start)
        block.zero_grad(set_to_none=True)
        costs.append(sorted(times)[len(times) // 2])
        with torch.no_grad():
            x = block(_clone(x))
    return costs


def choose_balance(
    blocks: Sequence[nn.Module],
    n_stages: int,
    by: str = "params",
    sample: torch.Tensor | None = None,
    balance: Sequence[int] | None = None,
) -> list[int]:
    """Pick cut points: explicit `balance`, or solve over `by` = "params" | "time".

    Raises:
        BrigadeError: for a balance that does not fit, too many stages, or an unknown `by`.
    """
    _check_stages(len(blocks), n_stages)
    if balance is not None:
        check_balance(balance, len(blocks), n_stages)
        return list(balance)
    if by == "params":
        return solve(param_costs(blocks), n_stages)
    if by == "time":
        if sample is None:
            raise BrigadeError("balance by time needs a sample batch to measure on")
        # Measure copies: a timing pass must not move BatchNorm statistics or leave gradients.
        return solve(time_costs(copy.deepcopy(list(blocks)), sample), n_stages)
    raise BrigadeError(f"unknown balance method {by!r}: expected params or time")


def split(blocks: Sequence[nn.Module], balance: Sequence[int]) -> list[nn.Module]:
    """Group blocks into one module per stage (modules are shared, not copied).

    A stage is an `nn.Sequential` of its blocks; when a block of the model declares side
    inputs (`side.needed`) every stage is a `side.StageModule` instead, which hands each block
    its side inputs and names the block and stage when one cannot take the previous output.
    """
    from brigade.pipeline.side import StageModule, needed  # side imports nothing of this module

    check_balance(balance, len(blocks))
    side = bool(needed(list(blocks)))
    stages, start = [], 0
    for s, n in enumerate(balance):
        part = blocks[start : start + n]
        stages.append(StageModule(part, range(start, start + n), stage=s) if side else nn.Sequential(*part))
        start += n
    return stages


def check_chain(blocks: Sequence[nn.Module], sample: torch.Tensor) -> None:
    """Run `sample` through the blocks once; name both blocks if one's output does not fit the next.

    A structured sample, or blocks that take side inputs, run through `side.whole`: its
    StageModule names the block (and stage) that cannot take what comes before it.

    Raises:
        BrigadeError: naming block i, block i+1 and the shape that did not fit.
    """
    from brigade.pipeline.side import needed, whole

    if needed(list(blocks)) or not torch.is_tensor(sample):
        with torch.no_grad():
            whole(list(blocks))(sample)
        return
    x = sample
    with torch.no_grad():
        for i, block in enumerate(blocks):
            try:
                y = block(x)
            except (RuntimeError, ValueError, TypeError, IndexError) as exc:
                where = (
                    f"block {i - 1} ({type(blocks[i - 1]).__name__}) outputs shape "
                    f"{tuple(x.shape)}, which block {i} ({type(block).__name__}) cannot take"
                    if i
                    else f"block 0 ({type(block).__name__}) cannot take the input of shape "
                    f"{tuple(x.shape)}"
                )
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise BrigadeError(f"{where}: {first}") from None
            if not isinstance(y, torch.Tensor):
                raise BrigadeError(
                    f"block {i} ({type(block).__name__}) returned {type(y).__name__}; "
                    "each block must return one tensor"
                )
            x = y


