"""Bytes held for backward (brigade/parallel/held.py): counted once per storage while autograd keeps
them, released with their graph; under recompute, what the frames keep instead."""

import torch
from torch import nn

from brigade.parallel import recompute
from brigade.parallel.held import Held


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())


def test_saved_tensors_count_once_per_storage_and_leave_with_their_graph():
    model, x = _mlp(), torch.randn(16, 64)
    with Held() as held:
        y = model(x)
        # x (saved by the first Linear) and each tanh's output (saved by it and by the next
        # Linear: one storage); the weights (saved transposed, a view) are the parameters'
        assert held.now == 3 * 16 * 64 * 4
        y.sum().backward()
        assert held.now == 0 and held.peak == 3 * 16 * 64 * 4


def test_excluded_storages_and_parameters_are_not_counted():
    w = torch.randn(64, 64, requires_grad=True)  # a weight that is not an nn.Parameter
    x = torch.randn(8, 64)
    with Held(exclude=[w]) as held:
        (x @ w).sum().backward()
    assert held.peak == 8 * 64 * 4  # x only


def test_full_recompute_holds_the_block_inputs_until_its_backward():
    blocks = list(_mlp())
    recompute.apply(blocks, "full")
    x = torch.randn(16, 64, requires_grad=True)
    with Held() as held:
        h = x
        for b in blocks:
            h = b(h)
        assert held.now == 4 * 16 * 64 * 4  # the four blocks' inputs, nothing else
        h.sum().backward()
        assert held.now == 0
    # at the peak: the four inputs and the last block's recomputed output (tanh saves it)
    assert held.peak == 5 * 16 * 64 * 4
