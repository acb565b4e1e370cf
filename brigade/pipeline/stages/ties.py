"""Shared weights: one parameter used by several blocks (a tied embedding and output head).

On one device a shared parameter needs nothing: autograd sums its gradient over every use.
Split over stages, each block that uses it needs its own copy on its own device:

    ties = find_shared(blocks)        # which parameter objects two or more blocks reach
    untie(blocks, ties)               # blocks after the first get a copy (same values)
    ...forward, backward on every stage...
    sum_tied_grads(ties, held, groups)  # every copy's grad := the sum over all copies
    optimizer.step()                  # identical grads, identical states: copies stay equal

`StageTies` does all of it for a model cut into stages. `groups` (a `TieGroups`, built on every
rank in the same order) holds, per tie, a process group of exactly the ranks that hold a copy;
copies in one process are summed locally first.
A snapshot stores each tie once, under its canonical name (`aliases`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from brigade.dtensors import local
from brigade.errors import BrigadeError


@dataclass(frozen=True)
class Tie:
    """One parameter used by several blocks.

    name: the canonical name, `blocks.<i>.<path>` of its first use.
    uses: every (block index, path inside that block) using it, first use first.
    """

    name: str
    uses: tuple[tuple[int, str], ...]

    @property
    def blocks(self) -> tuple[int, ...]:
        """The distinct blocks that use it, in order."""
        return tuple(dict.fromkeys(i for i, _ in self.uses))


def find_shared(blocks: Sequence[nn.Module]) -> list[Tie]:
    """Every parameter object reachable from two or more blocks, in order of first use.

    Args:
        blocks: the model's blocks, in order (before `untie`).

    Returns:
        One `Tie` per shared parameter; empty if no block shares one.
    """
    uses: dict[int, list[tuple[int, str]]] = {}
    for i, block in enumerate(blocks):
        for path, p in block.named_parameters(remove_duplicate=False):
            uses.setdefault(id(p), []).append((i, path))
    ties = []
    for found in uses.values():
        if len({i for i, _ in found}) > 1:
            ties.append(Tie(f"blocks.{found[0][0]}.{found[0][1]}", tuple(found)))
    return ties


def parameter(block: nn.Module, path: str) -> nn.Parameter:
    """The parameter at `path` ("out.weight") inside `block`."""
    owner, _, leaf = path.rpartition(".")
    return getattr(block.get_submodule(owner), leaf)


def untie(blocks: Sequence[nn.Module], ties: Sequence[Tie] | None = None) -> list[Tie]:
    """Give every block but a tie's first its own copy of the shared parameter (same values).

    A submodule object shared between blocks is first replaced by a deep copy in the later
    block, so that changing it does not change the first block.

    Args:
        blocks: the model's blocks, changed in place.
        ties: from `find_shared(blocks)` (the default).

    Returns:
        The ties: the record `sum_tied_grads` and `aliases` need.

    Raises:
        BrigadeError: one module object at two positions of the block list.
    """
    ties = find_shared(blocks) if ties is None else list(ties)
    seen: dict[int, int] = {}
    for b, block in enumerate(blocks):
        j = seen.setdefault(id(block), b)
        if j != b:
            raise BrigadeError(f"blocks {j} and {b} are the same module object: give each position its "
                               "own block (blocks may share parameters, as head.weight = embed.weight)")
    for b, block in enumerate(blocks):
        elsewhere = {id(m) for j, other in enumerate(blocks) if j != b for m in other.modules()}
        for tie in ties:
            paths = [path for i, path in tie.uses if i == b]
            if not paths or tie.blocks[0] == b:
                continue
            first = parameter(blocks[tie.blocks[0]], tie.uses[0][1])
            twin = nn.Parameter(first.detach().clone(), requires_grad=first.requires_grad)
            for path in paths:
                owner, _, leaf = path.rpartition(".")
                _own(block, owner, elsewhere)
                setattr(block.get_submodule(owner), leaf, twin)
    return ties


def _own(block: nn.Module, owner: str, elsewhere: set[int]) -> None:
    """Replace the first module on the way to `owner` that other blocks also hold by a deep copy."""
    module = block
    for name in owner.split(".") if owner else []:
        child = getattr(module, name)
        if id(child) in elsewhere:
            setattr(module, name, copy.deepcopy(child))
            return
        module = child


def aliases(ties: Sequence[Tie]) -> dict[str, str]:
    """`blocks.<i>.<path>` of every use but the canonical one → the tie's canonical name.

    A snapshot stores a tie once, under its canonical name; a loader fills each alias from it.
    """
    return {f"blocks.{i}.{path}": tie.name for tie in ties for i, path in tie.uses[1:]
            if f"blocks.{i}.{path}" != tie.name}


class TieGroups:
    """Per tie, the process group of exactly the ranks that hold a copy of it.

    Built on every rank with the same arguments (torch.distributed.new_group must be called
    by all ranks in the same order), after the default group is initialized.

    Args:
        ties: the model's ties.
        placements: one {block index: rank} per pipeline replica (one with data parallelism off).

    Raises:
        BrigadeError: a placement that does not name the rank of a tied block.
    """

    def __init__(self, ties: Sequence[Tie], placements: Sequence[Mapping[int, int]]):
        me = dist.get_rank()
        self.groups: dict[int, dist.ProcessGroup] = {}
        for k, tie in enumerate(ties):
            for placement in placements:
                missing = [b for b in tie.blocks if b not in placement]
                if missing:
                    raise BrigadeError(f"placement {dict(placement)} has no rank for block {missing[0]}, "
                                       f"which uses the shared parameter {tie.name}: place every block")
                ranks = sorted({placement[b] for b in tie.blocks})
                if len(ranks) < 2:
                    continue  # every copy in one process: summed locally
                group = dist.new_group(ranks)
                if me in ranks:
                    self.groups[k] = group

    def group(self, k: int) -> dist.ProcessGroup | None:
        """The group of tie `k` this rank belongs to, or None (all its copies are local)."""
        return self.groups.get(k)


def sum_tied_grads(ties: Sequence[Tie], held: Mapping[int, nn.Module],
                   groups: TieGroups | None = None) -> None:
    """After backward: set every copy's gradient to the sum of all copies' gradients.

    Copies in this process (possibly on several devices) are summed here, then all-reduced
    (SUM) over the tie's group; a copy without a gradient counts as zero. Every rank holding a
    copy must call this, with the ties in the same order.

    Args:
        ties: the record `untie` returned.
        held: this process's blocks, {block index: block}.
        groups: the ranks holding each tie; None when every block lives in this process.
    """
    for k, tie in enumerate(ties):
        copies = list({id(p): p for p in (parameter(held[i], path) for i, path in tie.uses if i in held)
                       }.values())
        group = groups.group(k) if groups is not None else None
        if not copies or (len(copies) == 1 and group is None):
            continue  # one copy in all the world: autograd already summed its uses
        # Sharded copies (FSDP2) sum shard by shard: every copy of a tie has the same shape and
        # mesh, so the copies on one data-parallel row hold the same part of it.
        grads = [local(p.grad) for p in copies if p.grad is not None]
        if not grads and group is None:
            continue
        device = local(copies[0]).device
        total = torch.zeros_like(local(copies[0])) if not grads else grads[0].to(device, copy=True)
        for g in grads[1:]:
            total += g.to(device)
        if group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        for p in copies:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # a DTensor's zeros are a DTensor like it
            local(p.grad).copy_(total)


class StageTies:
    """A model's ties once it is cut into stages: untied where they cross stages, with the groups
    that sum their copies.

    A tie whose users all sit on one stage needs nothing (autograd sums its uses). A tie across
    stages is untied (each later stage gets its own copy, same values), and after each step's last
    backward every copy's gradient becomes the sum over all copies:

        pp 2, GPT tied:   rank 0 holds blocks.0.tok.weight      rank 1 holds blocks.3.out.weight
                          grad := g0 + g1  (all-reduce over the tie's group {0, 1}, one per pipeline line)

    The gradient norm counts a tie once (its canonical copy); snapshots store it once, under the
    canonical name (`aliases`, read by brigade.snapshot.collective).

    Built on every rank with the same arguments, after the default group is initialized and
    before the blocks are moved, wrapped or handed to an optimizer.

    Args:
        blocks: the whole model's blocks (identical on every rank); changed in place.
        balance: blocks per stage.
        ranks: stage → pipeline rank (`plans.schedule.placement`).
        lines: every pipeline line of the world, the global rank of each pipeline rank on it
            (`world.World.tie_ranks`); None: every stage runs in this process (local stages, or
            one pipeline rank), and copies are summed here.
    """

    def __init__(self, blocks: list[nn.Module], balance: Sequence[int], ranks: Sequence[int],
                 lines: Sequence[Sequence[int]] | None):
        found = find_shared(blocks)
        stage = [s for s, n in enumerate(balance) for _ in range(n)]
        self.ties: list[Tie] = [t for t in found if len({stage[b] for b in t.blocks}) > 1]
        untie(blocks, self.ties)
        # Every tie's aliases, crossing stages or not: a snapshot names each tie once either way.
        self.aliases: dict[str, str] = aliases(found)
        self.groups: TieGroups | None = None
        if self.ties and lines is not None:
            self.groups = TieGroups(self.ties, [{b: line[ranks[stage[b]]] for b in range(len(blocks))}
                                                for line in lines])

    def sum_grads(self, held: Mapping[int, nn.Module]) -> None:
        """After the step's last backward: every copy's gradient := the sum over all copies.

        Args:
            held: this process's blocks, {block index: block}.
        """
        if self.ties:
            sum_tied_grads(self.ties, held, self.groups)
