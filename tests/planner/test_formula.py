"""Costs from shapes (`planner.formula`): a model built on the meta device, its parameters and FLOPs
a real model's, its saved bytes from 3 % under to 25 % over what a real run measures (a tensor
autograd saves twice counts twice), its times FLOPs over the
assumed share of the target's peak; and a model far too large for this machine costed in seconds."""

import time

import pytest
import torch

from brigade.models import load_model
from brigade.models.gpt import GPTConfig
from brigade.planner.costs import FORMULA, measure_memory
from brigade.planner.devices import device
from brigade.planner.formula import ASSUMED_MFU, from_shapes

SMALL = GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=64)


def _meta(cfg: GPTConfig):
    with torch.device("meta"):
        return load_model("gpt", seed=0, gpt_cfg=cfg)


def test_shapes_give_the_flops_and_at_least_the_bytes_a_real_run_measures():
    h100 = device("h100")
    costs = from_shapes(_meta(SMALL), 4, ["none", "full"], h100)
    real = load_model("gpt", seed=0, gpt_cfg=SMALL)
    measured = measure_memory(real, 4, ["none"])
    assert costs.source == FORMULA and costs.n_blocks == len(real.blocks)
    for b, block in enumerate(real.blocks):  # the same parameters, block by block
        assert sum(costs.params[b].values()) == sum(p.numel() * 4 for p in block.parameters())
    # a transformer block's forward: 2 FLOPs per weight per token for its matmuls, and more
    layer = sum(p.numel() for n, p in real.blocks[1].named_parameters() if p.dim() == 2)
    assert costs.flops[1] >= 3 * 2 * layer * SMALL.block_size
    for b in range(costs.n_blocks):
        assert 0.97 <= costs.modes["none"].held[b] / measured.modes["none"].held[b] <= 1.25
        assert costs.modes["full"].held[b] <= costs.modes["none"].held[b]  # only the input kept
    f, bwd, w, i = costs.block_times("none", 4)[1]
    assert f == pytest.approx(costs.flops[1] * 4 / 3 / (h100.peak("") * ASSUMED_MFU), rel=0.05)
    assert w == i == pytest.approx(bwd / 2)


def test_shapes_give_what_a_split_backward_keeps_from_i_to_w():
    costs = from_shapes(_meta(SMALL), 4, ["none", "full"], device("h100"))
    measured = measure_memory(load_model("gpt", seed=0, gpt_cfg=SMALL), 4, ["none", "full"])
    # block 0's figure is never read (a first stage keeps its output's gradient: planner.memory)
    for b in range(1, costs.n_blocks):  # the output bytes of every weight: the kept gradients' exactly
        assert costs.modes["none"].kept[b] == measured.modes["none"].kept[b]
        # recomputed, the forward's tensors too, as autograd saves them (twice where it does): high
        assert 1.0 <= costs.modes["full"].kept[b] / measured.modes["full"].kept[b] <= 1.3


def test_a_model_too_large_for_this_machine_is_costed_from_shapes_in_seconds():
    big = GPTConfig(vocab_size=32000, block_size=2048, n_layer=4, n_head=32, n_embd=8192)
    start = time.perf_counter()
    costs = from_shapes(_meta(big), 1, ["none"], device("h100"), "bf16")
    assert time.perf_counter() - start < 60
    params = sum(sum(b.values()) for b in costs.params)
    assert params > 12e9  # about 3.5 B parameters in fp32: more than this machine should hold
    assert all(t > 0 for t in costs.block_times("none", 1)[1])
