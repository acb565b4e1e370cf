"""The optimizer and its schedule (brigade/train/optimizer.py): the learning rate warms up, then
decays to its minimum; AdamW is fused by default, decays matrices only, and updates as its
one-tensor-at-a-time loop does."""

import copy
import math

import pytest
import torch

from brigade.config import OptimConfig
from brigade.config.lr import LR_SCHEDULES
from brigade.train.optimizer import SHAPES, adamw, lr_at


def test_lr_warms_up_then_decays_to_min():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(0, cfg, 100) == pytest.approx(0.1)
    assert lr_at(9, cfg, 100) == pytest.approx(1.0)
    assert lr_at(10, cfg, 100) == pytest.approx(1.0)
    assert lr_at(55, cfg, 100) == pytest.approx(0.55)
    assert lr_at(100, cfg, 100) == pytest.approx(0.1)


def test_every_named_schedule_has_a_shape():
    assert list(SHAPES) == list(LR_SCHEDULES)


@pytest.mark.parametrize("schedule,at", [
    # steps 10 (the warm-up's end), 55 (half way), 82 (wsd's decay starts: the last 0.2 of 90
    # steps), 91, 100 (--max-steps), 120 (past it: --min-lr held)
    ("cosine", [1.0, 0.55, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 72 / 90)), None, 0.1, 0.1]),
    ("linear", [1.0, 0.55, 0.1 + 0.9 * (1 - 72 / 90), 0.19, 0.1, 0.1]),
    ("wsd", [1.0, 1.0, 1.0, 0.55, 0.1, 0.1]),
    ("constant", [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
])
def test_each_schedule_warms_up_then_takes_its_way_down(schedule, at):
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, lr_schedule=schedule)
    assert lr_at(0, cfg, 100) == pytest.approx(0.1)  # the warm-up is every schedule's
    for step, want in zip((10, 55, 82, 91, 100, 120), at):
        if want is not None:
            assert lr_at(step, cfg, 100) == pytest.approx(want), step


def test_decay_steps_end_the_decay_there_whatever_max_steps_is():
    for schedule in ("cosine", "linear", "wsd"):
        cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, lr_schedule=schedule, decay_steps=50)
        assert lr_at(50, cfg, 100) == lr_at(80, cfg, 100) == pytest.approx(0.1)
        assert lr_at(30, cfg, 1000) == lr_at(30, cfg, 60)  # the run's length does not move it
        longer = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, lr_schedule=schedule, decay_steps=100)
        assert lr_at(30, longer, 100) == lr_at(30, OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10,
                                                               lr_schedule=schedule), 100)


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
