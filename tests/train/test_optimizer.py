"""The optimizer and its schedule (brigade/train/optimizer.py): the learning rate warms up, then
decays to its minimum; AdamW is fused by default, decays matrices only, and updates as its
one-tensor-at-a-time loop does."""

import copy

import pytest
import torch

from brigade.config import OptimConfig
from brigade.train.optimizer import adamw, lr_at


def test_lr_warms_up_then_decays_to_min():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(0, cfg, 100) == pytest.approx(0.1)
    assert lr_at(9, cfg, 100) == pytest.approx(1.0)
    assert lr_at(10, cfg, 100) == pytest.approx(1.0)
    assert lr_at(55, cfg, 100) == pytest.approx(0.55)
    assert lr_at(100, cfg, 100) == pytest.approx(0.1)


def test_adamw_is_fused_by_default_and_updates_as_one_tensor_at_a_time_does():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    twin = copy.deepcopy(model)
    fused, loop = adamw(OptimConfig())(model), adamw(OptimConfig(adamw="for-loop"))(twin)
    assert fused.defaults["fused"] and not loop.defaults["fused"] and not loop.defaults["foreach"]
    assert [g["weight_decay"] for g in fused.param_groups] == [0.1, 0.0]  # matrices only
    for _ in range(3):
        x = torch.randn(4, 8)
        for m, opt in ((model, fused), (twin, loop)):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
