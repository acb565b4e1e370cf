"""The CPU's activation meter (`measure.activations`): what a schedule holds at once, counted from
the tensors autograd saves."""

import pytest
import torch
from torch import nn

from brigade.measure.activations import ActivationMeter


def test_activation_meter_sees_gpipe_hold_more_than_one_microbatch():
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
    xs = [torch.randn(16, 64) for _ in range(4)]
    with ActivationMeter(exclude=list(model.parameters())) as all_first:
        outs = [model(x).sum() for x in xs]  # GPipe: every forward before any backward
        for o in outs:
            o.backward()
    del outs
    with ActivationMeter(exclude=list(model.parameters())) as one_by_one:
        for x in xs:
            model(x).sum().backward()  # 1F1B on one stage: one micro-batch in flight
    assert one_by_one.peak_bytes > 0
    assert all_first.peak_bytes == pytest.approx(4 * one_by_one.peak_bytes, rel=0.01)
    assert one_by_one.now == 0  # every saved tensor released with its graph
