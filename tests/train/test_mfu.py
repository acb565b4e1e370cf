"""Model FLOPs utilisation (brigade/train/mfu.py): the model's FLOPs per sample from the planner's
count, the peak a device is held to, and the records' figures."""

import types

import pytest
import torch

from brigade.config import RunConfig
from brigade.host import peaks
from brigade.train import mfu


def _gpt(vocab: int, layers: int = 2, width: int = 32, heads: int = 2):
    """A GPT's blocks and loss, built with weights, as a run builds them."""
    from brigade.config import ModelConfig
    from brigade.train.data import from_config

    spec = from_config(ModelConfig(n_layer=layers, n_embd=width, n_head=heads, context=32), vocab_size=vocab)
    return spec.blocks, spec.loss_fn


def test_a_gpts_flops_are_the_textbook_count():
    """3 × the forward's matmuls (the backward's two gradients cost two forwards): 2 FLOPs a
    weight a token in the blocks' 12·d² and the head's d·V, and attention's two T × T products;
    the counter's attention backward adds its kernel's recomputed scores (2·T·T·d a layer), so the
    count sits within 3 % above the textbook's."""
    vocab, layers, d, t = 50, 2, 32, 16
    x, y = torch.randint(vocab, (1, t)), torch.randint(vocab, (1, t))
    got = mfu.flops_per_sample(*_gpt(vocab, layers, d), (x, y))
    textbook = 3 * t * (2 * (12 * layers * d * d + d * vocab) + 4 * layers * t * d)
    assert textbook <= got <= 1.03 * textbook


def test_the_flops_are_per_sample_whatever_the_batch():
    x, y = torch.randint(50, (3, 16)), torch.randint(50, (3, 16))
    assert mfu.flops_per_sample(*_gpt(50), (x, y)) == mfu.flops_per_sample(*_gpt(50), (x[:1], y[:1]))


def test_a_step_is_held_to_every_device_at_its_peak():
    u = mfu.Utilization(flops_per_step=8e12, peak_per_device=1e12, devices=4)
    assert u.of(4.0) == {"mfu": pytest.approx(0.5), "tflops": pytest.approx(0.5)}


def test_the_peak_is_the_flag_then_the_table_then_a_core():
    cfg = RunConfig()
    cfg.train.peak_tflops = 123.0
    assert mfu.peak_per_device(cfg, torch.device("cpu")) == 123e12
    cfg.train.peak_tflops, cfg.parallel.threads = 0.0, 2
    assert mfu.peak_per_device(cfg, torch.device("cpu")) > 0  # a core measured, × 2 threads
    assert peaks.gpu_peak("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert peaks.gpu_peak("NVIDIA A100-SXM4-80GB") == 19.5e12  # fp32
    assert peaks.gpu_peak("NVIDIA H200", "fp16") == 989e12
    assert peaks.gpu_peak("NVIDIA L4") is None  # not in the table: no MFU without --peak-tflops


def test_a_model_that_needs_real_tensors_trains_on_without_mfu(tmp_path, capsys):
    """A block that reads a value (`.item()`) cannot run on the meta device: the run says so in
    one line and logs no MFU, instead of failing."""
    from brigade.train.run import _utilization

    (tmp_path / "reads.py").write_text(
        "import torch.nn as nn\n"
        "class Reads(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.lin = nn.Linear(4, 4)\n"
        "    def forward(self, x):\n        return self.lin(x) * float(x.abs().max().item() > 0)\n"
        "def make():\n    return [Reads(), nn.Linear(4, 2)]\n")
    from brigade.models import load_model

    spec = load_model(f"{tmp_path / 'reads.py'}:make")
    data = [(torch.randn(4), torch.randn(2))]
    info = types.SimpleNamespace(device=torch.device("cpu"), world_size=1)
    assert _utilization(RunConfig(), spec.blocks, spec.loss_fn, data, info) is None
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("brigade: MFU left out of the log: the model's FLOPs "
                                                 "could not be counted on the meta device")


def test_counting_leaves_the_model_as_it_was():
    """A mixture of experts keeps routing counts from each forward: counted on a meta copy, the
    run's own blocks keep theirs real and train on (the ep × pp exact-resume world once failed
    its first step on a meta count left in the model)."""
    from brigade.config import ModelConfig
    from brigade.train.data import from_config

    spec = from_config(ModelConfig(n_layer=2, n_embd=32, n_head=2, context=16, experts=4), vocab_size=50)
    x, y = torch.randint(50, (2, 16)), torch.randint(50, (2, 16))
    assert mfu.flops_per_sample(spec.blocks, spec.loss_fn, (x[:1], y[:1])) > 0
    assert not any(t.is_meta for b in spec.blocks for t in [*b.parameters(), *b.buffers()])
    h = x
    for block in spec.blocks:
        h = block(h)
    spec.loss_fn(h, y).backward()  # a real step's forward and backward, as before the count
