"""LoRA (`parallel.lora`): adapters that start as the base model, train alone, fold back into the
weights, and one line for each bad input; `brigade check --lora` equal to one device (the
registry's schedules under every axis: tests/check/test_lora.py)."""

import copy

import pytest
import torch
from torch import nn

from brigade.config import ModelConfig
from brigade.errors import BrigadeError
from brigade.models.gpt import GPTConfig, gpt, gpt_loss
from brigade.parallel import lora

TINY = GPTConfig(vocab_size=30, block_size=16, n_layer=2, n_head=2, n_embd=16)


def _gpt():
    torch.manual_seed(0)
    return gpt(TINY)


def test_adapters_start_as_the_base_model_and_only_they_train():
    blocks = _gpt()
    base = copy.deepcopy(blocks)
    count = lora.apply(blocks, list(range(len(blocks))), lora.LoraSpec(4, 8.0))
    x, y = torch.randint(0, 30, (2, 16)), torch.randint(0, 30, (2, 16))
    model = nn.Sequential(*blocks)
    out = model(x)
    assert torch.equal(out, nn.Sequential(*base)(x))  # B is zero
    gpt_loss(out, y).backward()
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(lora.is_adapter(n) for n in trained)
    assert {n.rsplit(".", 2)[-2] for n in trained} == {"qkv", "proj", "0", "2"}
    assert count == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)
    # per layer: r × in + out × r for qkv (16→48), proj (16→16), mlp.0 (16→64), mlp.2 (64→16)
    assert count == 2 * 4 * (16 + 48 + 16 + 16 + 16 + 64 + 64 + 16)


def test_a_is_drawn_from_the_seed_and_the_name_whatever_is_held():
    one, two = _gpt(), _gpt()
    lora.apply(one, [1, 2], lora.LoraSpec(4, seed=3))
    lora.apply(two, [2], lora.LoraSpec(4, seed=3))  # another process, holding block 2 only
    assert torch.equal(one[2].attn.qkv.lora_a, two[2].attn.qkv.lora_a)
    assert not torch.equal(one[1].attn.qkv.lora_a, one[2].attn.qkv.lora_a)
    assert not hasattr(two[1].attn.qkv, "lora_a") and two[1].attn.qkv.weight.requires_grad


def test_merge_folds_the_adapters_into_the_weights():
    blocks = _gpt()
    lora.apply(blocks, list(range(len(blocks))), lora.LoraSpec(4, 8.0, draw_b=True))
    x = torch.randint(0, 30, (2, 16))
    model = nn.Sequential(*blocks)
    before = model(x)
    lora.merge(blocks)
    assert not any(lora.is_adapter(n) for n, _ in model.named_parameters())
    torch.testing.assert_close(model(x), before, atol=1e-5, rtol=0)


def test_targets_by_name_and_by_the_last_parts_of_names():
    blocks = _gpt()
    assert lora.targets(blocks, lora.LoraSpec(2, targets=("qkv",))) == {1: ["attn.qkv"], 2: ["attn.qkv"]}
    assert lora.targets(blocks, lora.LoraSpec(2, targets=("attn.proj", "mlp.2")))[1] == ["attn.proj", "mlp.2"]


@pytest.mark.parametrize("fields,message", [
    ({"lora": -1}, "--lora -1: the adapters' rank must be ≥ 1 (8 or 16 are usual); 0 trains every weight"),
    ({"lora": 4, "lora_dropout": 1.0}, "--lora-dropout 1.0: must be at least 0 and below 1"),
    ({"lora": 4, "lora_alpha": 0.0}, "--lora-alpha 0.0: must be above 0"),
])
def test_bad_settings_get_one_line(fields, message):
    with pytest.raises(BrigadeError) as e:
        lora.spec_of(ModelConfig(**fields), 0)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_target_naming_nothing_gets_one_line_with_what_there_is():
    with pytest.raises(BrigadeError, match=r"^--lora-targets qkv,wq: 'wq' names no linear layer of the "
                                           r"model's blocks; they have: attn.proj, attn.qkv, mlp.0, "
                                           r"mlp.2, out$"):
        lora.targets(_gpt(), lora.LoraSpec(2, targets=("qkv", "wq")))
    plain = [nn.Sequential(nn.Linear(4, 4), nn.GELU()), nn.Linear(4, 2)]
    with pytest.raises(BrigadeError, match=r"^--lora: none of the model's linear layers is an attention "
                                           r"or MLP projection it knows by name; name them with "
                                           r"--lora-targets \(they have: 0\)"):
        lora.targets(plain, lora.LoraSpec(2))


def test_no_lora_without_a_rank_and_float8_refused():
    assert lora.spec_of(ModelConfig(), 0) is None
    with pytest.raises(BrigadeError, match=r"^--lora with --float8 rowwise: the adapters are not converted"):
        lora.check_with("rowwise")
