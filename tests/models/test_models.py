import pytest
import torch
from torch import nn

from brigade.errors import BrigadeError
from brigade.models import as_blocks, load_model
from brigade.models.gpt import GPTConfig, gpt
from brigade.models.resnet import resnet50
from brigade.models.toy import toy


def test_gpt_blocks_and_shapes():
    cfg = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32)
    blocks = gpt(cfg)
    assert [type(b).__name__ for b in blocks] == ["Embedding", "Block", "Block", "Head"]
    x = torch.randint(50, (3, 16))
    assert nn.Sequential(*blocks)(x).shape == (3, 16, 50)
    assert blocks[0].tok.weight is blocks[-1].out.weight  # tied: brigade keeps a copy per stage


def test_gpt_rejects_too_long_sequences():
    blocks = gpt(GPTConfig(block_size=8, n_layer=1, n_embd=16, n_head=2))
    with pytest.raises(ValueError, match="exceeds block_size 8"):
        blocks[0](torch.zeros(1, 9, dtype=torch.long))


def test_gpt_is_causal():
    blocks = gpt(GPTConfig(vocab_size=20, block_size=8, n_layer=2, n_head=2, n_embd=16))
    model = nn.Sequential(*blocks)
    x = torch.randint(20, (1, 8))
    y = x.clone()
    y[0, -1] = (x[0, -1] + 1) % 20
    assert torch.allclose(model(x)[:, :-1], model(y)[:, :-1])


def test_resnet50_matches_torchvision_size():
    blocks = resnet50()
    assert len(blocks) == 18
    assert sum(p.numel() for b in blocks for p in b.parameters()) == 25_557_032
    out = nn.Sequential(*blocks).eval()(torch.randn(1, 3, 64, 64))
    assert out.shape == (1, 1000)


def test_toy_is_the_tutorials():
    a, relu, b = toy()
    assert (a.in_features, a.out_features, b.in_features, b.out_features) == (10, 10, 10, 5)
    assert isinstance(relu, nn.ReLU)


def test_same_seed_same_weights():
    a, b = load_model("toy", seed=3).blocks, load_model("toy", seed=3).blocks
    assert torch.equal(a[0].weight, b[0].weight)


def write(tmp_path, body):
    f = tmp_path / "user_model.py"
    f.write_text(body)
    return str(f)


def test_factory_returning_sequential(tmp_path):
    f = write(tmp_path, "import torch.nn as nn\ndef make():\n"
                        "    return nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2))\n")
    spec = load_model(f"{f}:make")
    assert len(spec.blocks) == 3
    x, y = spec.make_batch(5, torch.Generator().manual_seed(0))
    assert x.shape == (5, 6) and y.shape == (5, 2)


def test_factory_with_its_own_batch_and_loss(tmp_path):
    f = write(tmp_path, "import torch, torch.nn as nn\n"
                        "def make():\n    return [nn.Linear(3, 3), nn.Linear(3, 1)]\n"
                        "def batch(n, g):\n    return torch.ones(n, 3), torch.zeros(n, 1)\n"
                        "def loss(out, y):\n    return (out - y).abs().mean()\n")
    spec = load_model(f"{f}:make")
    assert torch.equal(spec.make_batch(2, None)[0], torch.ones(2, 3))
    assert spec.loss_fn(torch.ones(2, 1), torch.zeros(2, 1)).item() == 1.0


@pytest.mark.parametrize("body,factory,message", [
    ("def make():\n    return 3\n", "make", "returned int: expected an nn.Sequential"),
    ("def make():\n    return []\n", "make", "returned no blocks"),
    ("def make():\n    raise KeyError('oops')\n", "make", "raised KeyError"),
    ("def other():\n    pass\n", "make", "has no factory 'make'.*other"),
    ("import nonexistent_pkg_xyz\n", "make", "failed to import: ModuleNotFoundError"),
])
def test_factory_errors(tmp_path, body, factory, message):
    f = write(tmp_path, body)
    with pytest.raises(BrigadeError, match=message):
        load_model(f"{f}:{factory}")


def test_missing_file_and_unknown_name(tmp_path):
    with pytest.raises(BrigadeError, match="not found"):
        load_model(f"{tmp_path}/nope.py:make")
    with pytest.raises(BrigadeError, match="unknown model 'vgg'"):
        load_model("vgg")


def test_as_blocks_accepts_lists_and_sequentials():
    assert len(as_blocks(nn.Sequential(nn.ReLU(), nn.ReLU()))) == 2
    with pytest.raises(BrigadeError):
        as_blocks([nn.ReLU(), "relu"])


def test_gpt_ties_its_head_unless_no_tie_embeddings():
    """The default GPT shares one (V, C) parameter between embedding and head; the flag unties it."""
    import argparse

    from brigade import config
    from brigade.train.data import from_config

    parser = argparse.ArgumentParser()
    config.add_flags(parser)
    counts = {}
    for flags, tied in (([], True), (["--no-tie-embeddings"], False), (["--tie-embeddings"], True)):
        cfg = config.build(parser.parse_args(["--n-layer", "1", "--n-embd", "16", "--n-head", "2", *flags]))
        assert cfg.model.tie_embeddings is tied
        blocks = from_config(cfg.model, vocab_size=11).blocks
        assert (blocks[-1].out.weight is blocks[0].tok.weight) is tied
        counts[tied] = sum(p.numel() for p in nn.ModuleList(blocks).parameters())
    assert counts[False] - counts[True] == 11 * 16  # the tied weight counts once
