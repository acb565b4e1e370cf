"""Shared parameters of a model split into stages: which ties cross stages, who holds them.

A tie whose users all sit on one stage needs nothing (autograd sums its uses). A tie across
stages is untied (`ties.untie`: each later stage gets its own copy, same values) and after
each step's backward every copy's gradient becomes the sum over all copies:

    pp 2, GPT tied:   rank 0 holds blocks.0.tok.weight      rank 1 holds blocks.3.out.weight
                      grad := g0 + g1  (all-reduce over the tie's group {0, 1}, one per dp row)

The gradient norm counts a tie once (its canonical copy); snapshots store it once, under the
canonical name (`aliases`, read by brigade.snapshot.collective).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from brigade.pipeline.stages.ties import Tie, TieGroups, aliases, find_shared, sum_tied_grads, untie


def stage_of_blocks(balance: Sequence[int]) -> list[int]:
    """Block index → the stage it runs in, for blocks cut by `balance`."""
    return [s for s, n in enumerate(balance) for _ in range(n)]


class StageTies:
    """The model's ties, untied where they cross stages, with their process groups.

    Built on every rank with the same arguments, after the default group is initialized and
    before the blocks are moved, wrapped or handed to an optimizer.

    Args:
        blocks: the whole model's blocks (identical on every rank); changed in place.
        balance: blocks per stage.
        ranks: stage → pipeline rank (`pipe.placement`).
        dp, pp: the layout's replicas and pipeline ranks; tp: its tensor-parallel width (global
            rank = (dp row · pp + pp rank) · tp + tp rank: one tie group per dp row and tp rank).
        local: every stage runs in this process (local stages): copies are summed here.
    """

    def __init__(self, blocks: list[nn.Module], balance: Sequence[int], ranks: Sequence[int],
                 dp: int, pp: int, local: bool, tp: int = 1):
        found = find_shared(blocks)
        stage = stage_of_blocks(balance)
        self.ties: list[Tie] = [t for t in found if len({stage[b] for b in t.blocks}) > 1]
        untie(blocks, self.ties)
        # Every tie's aliases, crossing stages or not: a snapshot names each tie once either way.
        self.aliases: dict[str, str] = aliases(found)
        self.groups: TieGroups | None = None
        if self.ties and not local and pp > 1:
            self.groups = TieGroups(self.ties, [{b: (row * pp + ranks[stage[b]]) * tp + t
                                                 for b in range(len(blocks))}
                                                for row in range(dp) for t in range(tp)])

    def sum_grads(self, held: Mapping[int, nn.Module]) -> None:
        """After the step's last backward: every copy's gradient := the sum over all copies.

        Args:
            held: this process's blocks, {block index: block}.
        """
        if self.ties:
            sum_tied_grads(self.ties, held, self.groups)
