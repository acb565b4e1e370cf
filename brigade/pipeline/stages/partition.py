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
from typing import Any

import torch
from torch import nn

from brigade.errors import BrigadeError
from brigade.pipeline.stages import structure


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


def _fresh(x: Any, grad: bool) -> Any:
    """A copy of a tensor or structure to time a block on: its tensors cloned, floating ones
    requiring a gradient when `grad` (as the pipeline hands a stage its received input)."""
    tensors, spec = structure.flatten(x, root="input")
    with torch.no_grad():
        copies = [t.detach().clone() for t in tensors]
    return structure.unflatten([c.requires_grad_(grad and c.is_floating_point()) for c in copies], spec)


def _synchronize(x: Any) -> None:
    """Wait for the GPU of a structure's first CUDA tensor, if any (the clock measures compute)."""
    cuda = next((t for t in structure.flatten(x, root="output")[0] if t.is_cuda), None)
    if cuda is not None:
        torch.cuda.synchronize(cuda.device)


def _backward_ones(y: Any) -> None:
    """Backward from every tensor of an output structure that requires a gradient (all ones)."""
    ys = [t for t in structure.flatten(y, root="output")[0] if t.requires_grad]
    if ys:
        torch.autograd.backward(ys, [torch.ones_like(t) for t in ys])


def time_costs(blocks: Sequence[nn.Module], sample: Any, repeats: int = 3) -> list[float]:
    """Measured forward+backward seconds per block on `sample` (median of `repeats`).

    `sample` is a batch's inputs, a tensor or a structure; a block may take and return either,
    and gets its declared side inputs (`side_inputs.split_inputs` of the sample) by keyword.

    Each block runs once untimed first: a first call pays one-off costs (kernel selection,
    allocations, oneDNN primitive creation on CPU) that would make early blocks look heavier
    and push the cut late (ResNet-50 on CPU: the second stage came out ~3× the first).

    Raises:
        BrigadeError: a side input a block declares is missing from the sample.
    """
    return [_median([f + b for f, b in runs]) for runs in _timed(blocks, sample, repeats)]


def time_parts(blocks: Sequence[nn.Module], sample: Any, repeats: int = 3) -> list[tuple[float, float]]:
    """Measured (forward, backward) seconds per block on `sample`, each the median of `repeats`,
    measured as `time_costs` measures (the same warm-up, inputs and side inputs): what auto's
    cut is chosen from where a run starts (`measured_cut.auto_balance`).

    Raises:
        BrigadeError: a side input a block declares is missing from the sample.
    """
    return [(_median([f for f, _ in runs]), _median([b for _, b in runs]))
            for runs in _timed(blocks, sample, repeats)]


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _timed(blocks: Sequence[nn.Module], sample: Any, repeats: int) -> list[list[tuple[float, float]]]:
    """Per block, `repeats` timed (forward, backward) pairs after one untimed call (`time_costs`)."""
    from brigade.pipeline.stages.side_inputs import declared, split_inputs

    x, side = split_inputs(sample, list(blocks))
    out_runs = []
    for i, block in enumerate(blocks):
        kwargs = {name: side[name] for name in declared(block, i)}
        runs = []
        for k in range(repeats + 1):
            inp = _fresh(x, grad=True)
            _synchronize(inp)  # the clock starts when the GPU is idle, not while it still copies
            start = time.perf_counter()
            out = block(inp, **kwargs)
            _synchronize(out)
            mid = time.perf_counter()
            _backward_ones(out)
            _synchronize(out)
            end = time.perf_counter()
            if k:  # the first, warm-up call is not timed
                runs.append((mid - start, end - mid))
        block.zero_grad(set_to_none=True)
        out_runs.append(runs)
        with torch.no_grad():
            x = block(_fresh(x, grad=False), **kwargs)
    return out_runs


def choose_balance(
    blocks: Sequence[nn.Module],
    n_stages: int,
    by: str = "params",
    sample: Any = None,
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
    inputs (`side_inputs.needed`) every stage is a `side_inputs.StageModule` instead, which hands
    each block its side inputs and names the block and stage when one cannot take the previous
    output.
    """
    from brigade.pipeline.stages.side_inputs import StageModule, needed  # side imports nothing of this module

    check_balance(balance, len(blocks))
    side = bool(needed(list(blocks)))
    stages, start = [], 0
    for s, n in enumerate(balance):
        part = blocks[start : start + n]
        stages.append(StageModule(part, range(start, start + n), stage=s) if side else nn.Sequential(*part))
        start += n
    return stages


def check_chain(blocks: Sequence[nn.Module], sample: Any) -> list[structure.Spec]:
    """Run `sample` through the blocks once, probing every block's output; name both blocks if
    one's output does not fit the next.

    Whether a model passes plain tensors is a property of the whole chain, not of its input: a
    block may turn a tensor into a structure (tuple, list, dict, namedtuple, nested) and a later
    one a structure back into a tensor. So each block is run on what the previous one returned
    (with its declared side inputs, taken out of the sample by `side_inputs.split_inputs`), and what it
    returns must be something a stage can send (`structure.flatten`).

    Returns:
        The description (`structure.Spec`) of every block's output, in order: all
        `structure.TENSOR` when only tensors pass from block to block.

    Raises:
        BrigadeError: naming block i, block i+1 and the shape or structure that did not fit; a
            block output that cannot be sent (naming the block and where in the output); a
            side input missing from the sample.
    """
    from brigade.pipeline.stages.side_inputs import MISMATCH, declared, split_inputs

    blocks = list(blocks)
    x, side = split_inputs(sample, blocks)
    specs = []
    with torch.no_grad():
        for i, block in enumerate(blocks):
            kwargs = {name: side[name] for name in declared(block, i)}
            try:
                y = block(x, **kwargs)
            except (BrigadeError, torch.OutOfMemoryError):
                raise
            except MISMATCH as exc:
                first = (str(exc).strip().splitlines() or [""])[0]
                raise BrigadeError(f"{_misfit(blocks, i, x)}: {type(exc).__name__}: {first}") from None
            specs.append(structure.flatten(y, root=f"block {i} ({type(block).__name__})'s output")[1])
            x = y
    return specs


def _misfit(blocks: list[nn.Module], i: int, x: Any) -> str:
    """Which block cannot take what: `block 0 (A) outputs shape (2, 7), which block 1 (B) cannot
    take`, or with a structure `... outputs dict('h': Tensor(2, 8) float32), which ...`."""
    what = f"shape {tuple(x.shape)}" if torch.is_tensor(x) else structure.describe(x)
    name = f"block {i} ({type(blocks[i]).__name__})"
    if i == 0:
        return f"{name} cannot take the input {'of ' if torch.is_tensor(x) else ''}{what}"
    return f"block {i - 1} ({type(blocks[i - 1]).__name__}) outputs {what}, which {name} cannot take"
