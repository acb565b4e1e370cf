"""Costs from shapes (`planner.formula`): a model built on the meta device, its parameters and FLOPs
a real model's, its saved bytes from 3 % under to 25 % over what a real run measures (a tensor
autograd saves twice counts twice), its times each kernel's work at the target's rate for it
(`planner.kernels`); and a model far too large for this machine costed in seconds."""

import time

import pytest
import torch

from brigade.models import load_model
from brigade.models.gpt import GPTConfig
from brigade.planner.costs import FORMULA, measure_memory
from brigade.planner.devices import device
from brigade.planner.formula import from_shapes

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
    rate = h100.peak("") * h100.matmul_eff  # the matmuls at least, and nothing faster than the peak
    assert costs.flops[1] * 4 / 3 / h100.peak("") < f
    assert f >= costs.flops[1] * 4 / 3 / rate * 0.5
    assert w + i == pytest.approx(bwd) and 0 < w < i  # W: half the backward's matmuls; I the rest


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


def test_attention_is_counted_as_a_fused_kernel_keeps_it_not_as_its_s_by_s_scores():
    long = GPTConfig(vocab_size=96, block_size=512, n_layer=1, n_head=8, n_embd=64)
    costs = from_shapes(_meta(long), 2, ["none"], device("h100"))
    # the meta device's reference would keep two 8 × 512 × 512 fp32 tensors a sample (16 MiB):
    # more than the whole block keeps on a real run, which takes a fused kernel (the CPU's flash)
    real = measure_memory(load_model("gpt", seed=0, gpt_cfg=long), 2, ["none"])
    assert 0.97 <= costs.modes["none"].held[1] / real.modes["none"].held[1] <= 1.25
    assert costs.modes["none"].held[1] < 2 * 8 * 512 * 512 * 4


def test_selective_keeps_the_input_and_the_outputs_of_the_matmuls_and_attention():
    costs = from_shapes(_meta(SMALL), 4, ["none", "selective"], device("h100"))
    real = measure_memory(load_model("gpt", seed=0, gpt_cfg=SMALL), 4, ["selective"])
    for b in range(costs.n_blocks):  # what the trainer's selective recompute holds, as measured
        # (the embedding's: its token ids, 256 bytes against 264 the allocator counts)
        assert 0.96 <= costs.modes["selective"].held[b] / real.modes["selective"].held[b] <= 1.25
    held, again = costs.modes["selective"].held[1], costs.modes["selective"].working[1]
    assert held < costs.modes["none"].held[1] and again > 0  # the cheap rest made again in backward
    assert held + again == pytest.approx(costs.modes["none"].held[1])
    for sel, none in zip(costs.block_times("selective", 4), costs.block_times("none", 4)):
        # no matmul runs again: the forward and W are none's; the memory-bound rest of the forward
        # runs again before I, less than the whole forward
        assert sel[0] == none[0] and sel[2] == none[2]
        assert none[3] <= sel[3] <= none[3] + none[0] * (1 + 1e-9) and sel[1] - none[1] == pytest.approx(sel[3] - none[3])


def test_float8_saves_for_the_backward_what_bf16_saves():
    """The formula counts a --float8 run's activations as its bf16 run's: torchao's float8 linear
    (tensorwise, dynamic scaling) saves its high-precision input and weight, not float8 copies, and
    keeps no amax history; its float8 casts live only inside each matmul. If a torchao release
    changes that, this fails and the formula's memory under --float8 needs the new term."""
    pytest.importorskip("torchao", reason="the float8 extra (scripts/setup.sh installs it)")
    from brigade.models.gpt import gpt
    from brigade.parallel.float8 import convert

    def saved(blocks: list[torch.nn.Module]) -> list[int]:
        x, out = torch.randn(4, 32, 64, dtype=torch.bfloat16, requires_grad=True), []
        for block in blocks[1:-1]:
            got = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: got.append(t) or t, lambda t: t):
                x = block(x)
            out.append(sum(t.numel() * t.element_size() for t in got))
        return out

    torch.manual_seed(0)
    plain = [b.to(torch.bfloat16) for b in gpt(SMALL)]
    torch.manual_seed(0)
    f8 = [b.to(torch.bfloat16) for b in gpt(SMALL)]
    convert(f8, "tensorwise")
    assert type(f8[1].mlp[0]).__name__ == "Float8Linear"
    assert saved(f8) == saved(plain)
    assert not [n for b in f8 for n, t in b.named_buffers() if "amax" in n]
