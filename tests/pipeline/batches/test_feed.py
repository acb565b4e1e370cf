"""From a batch to the runners' arguments: main and side inputs, micro-batches, targets."""

import pytest
import torch
from torch import nn

from brigade.errors import BrigadeError
from brigade.pipeline.batches import feed
from brigade.pipeline.stages.side_inputs import StageModule


class Masked(nn.Module):
    side_inputs = ("mask",)

    def forward(self, x, *, mask):
        return x * mask[:, None]


def _feed():
    stages = {0: StageModule([nn.Identity()], [0], stage=0), 1: StageModule([Masked()], [1], stage=1)}
    return feed.Feed(stages, feed.declarations(stages), feed.first_label(stages[0]))


def test_declarations_name_the_first_block_and_merge_keeps_the_earliest_stage():
    f = _feed()
    assert f.declared == {"mask": "stage 1: block 1 (Masked)"}
    assert feed.merge([{"m": "stage 3: block 5 (A)"}, {"m": "stage 1: block 2 (B)"}]) == \
        {"m": "stage 1: block 2 (B)"}


def test_side_inputs_go_to_the_stages_that_declare_them_per_micro_batch():
    f = _feed()
    batch = {"x": torch.randn(5, 2), "mask": torch.arange(5.0)}
    assert f.side(batch, 2, [0], torch.device("cpu")) is None  # stage 0 takes none
    sides = f.side(batch, 2, [1], torch.device("cpu"))
    assert [s["mask"].tolist() for s in sides] == [[0.0, 1.0, 2.0], [3.0, 4.0]]
    assert [x.shape[0] for x in f.inputs(batch, 2, torch.device("cpu"))] == [3, 2]


def test_structured_targets_and_weights():
    ys, ws = _feed().targets({"y": torch.zeros(4), "n": 3}, 2, torch.device("cpu"), loss_scale=0.5)
    assert [y["y"].shape[0] for y in ys] == [2, 2] and ys[0]["n"] == 3 and ws == [0.25, 0.25]


def test_a_rank_without_inputs_or_targets_is_told_what_to_pass():
    f = _feed()
    with pytest.raises(BrigadeError, match="stage 1: block 1 \\(Masked\\) takes side input 'mask' but "
                                           "this rank got no inputs: pass the batch's inputs"):
        f.side(None, 2, [1], torch.device("cpu"))
    with pytest.raises(BrigadeError, match="targets=None on the rank of the last stage"):
        f.targets(None, 2, torch.device("cpu"))
