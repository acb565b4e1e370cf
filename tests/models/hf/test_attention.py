"""hf:DIR attention: a batch without padding reaches SDPA with is_causal=True and no mask, in
every registered family (the registry is iterated, so a family added later is covered by
construction); a padded batch, or a sliding window shorter than the sequence, gets a mask; both
paths equal transformers within 1e-5."""

from __future__ import annotations

import pytest
import torch

from brigade.errors import BrigadeError
from brigade.models import load_model
from brigade.models.hf import blocks, families
from brigade.pipeline.stages.side_inputs import whole
from tests.models.hf.dirs import hf, tiny_dir

transformers = pytest.importorskip("transformers")
FAMILIES = sorted(families.FAMILIES)
LAYERS = 4  # tiny_dir's


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Every call of torch's scaled_dot_product_attention while the test runs, as (mask, is_causal)."""
    real = torch.nn.functional.scaled_dot_product_attention
    calls = []

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal", False)))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def _ids(spec, b: int = 3, t: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(spec.hf.config.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


def _theirs(family: str, ids: torch.Tensor, padding: torch.Tensor | None = None, **extra) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir(family, **extra)).eval()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=None if padding is None else padding.long()).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_no_padding_runs_sdpa_causal_without_a_mask_and_equals_transformers(family, sdpa_calls):
    spec = load_model(hf(family), block_size=16)
    ids = _ids(spec)
    inputs = spec.text_inputs(ids)
    assert inputs["attention_mask"] is None
    with torch.no_grad():
        ours = whole(spec.blocks).eval()(inputs)
    assert len(sdpa_calls) == LAYERS  # one per layer: the layers' attention is "sdpa"
    assert all(mask is None and causal is True for mask, causal in sdpa_calls), sdpa_calls
    torch.testing.assert_close(ours, _theirs(family, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_standalone_blocks_run_sdpa_causal_without_a_mask(family, sdpa_calls):
    """What bench, tune and plan time is the path a run without padding takes."""
    alone = load_model(hf(family), standalone=True)
    with torch.no_grad():
        torch.nn.Sequential(*alone.blocks).eval()(_ids(alone, 2, 12))
    assert len(sdpa_calls) == LAYERS
    assert all(mask is None and causal is True for mask, causal in sdpa_calls), sdpa_calls


@pytest.mark.parametrize("family", FAMILIES)
def test_padding_gets_a_mask_and_equals_transformers_on_real_tokens(family, sdpa_calls):
    """Row 0 unpadded, row 1 padded on the left (its real tokens must not see the padding), row 2
    on the right. Padded positions' logits are nobody's: only real tokens are compared."""
    spec = load_model(hf(family), block_size=16)
    ids = _ids(spec, seed=1)
    padding = torch.ones(3, 16, dtype=torch.long)  # as a tokenizer gives it
    padding[1, :5] = 0
    padding[2, 11:] = 0
    with torch.no_grad():
        ours = whole(spec.blocks).eval()(spec.text_inputs(ids, padding))
    assert len(sdpa_calls) == LAYERS
    assert all(mask is not None and causal is False for mask, causal in sdpa_calls)
    real = padding.bool()
    torch.testing.assert_close(ours[real], _theirs(family, ids, padding)[real], atol=1e-5, rtol=0)
    unmasked = _theirs(family, ids)  # the left padding changes what the real tokens see
    assert (unmasked[1, 5:] - _theirs(family, ids, padding)[1, 5:]).abs().max() > 1e-3


def test_a_window_gets_a_mask_only_where_it_cuts(sdpa_calls):
    """Mistral with a window of 5: over 5 tokens (query − key ≤ 4) it cuts nothing, no mask;
    over 6 and more it cuts, a mask. Both equal transformers."""
    spec = load_model(hf("mistral", sliding_window=5), block_size=16)
    for t, masked in ((5, False), (6, True), (16, True)):
        sdpa_calls.clear()
        ids = _ids(spec, 2, t, seed=t)
        with torch.no_grad():
            ours = whole(spec.blocks).eval()(spec.text_inputs(ids))
        assert [mask is not None for mask, _ in sdpa_calls] == [masked] * LAYERS, t
        torch.testing.assert_close(ours, _theirs("mistral", ids, sliding_window=5), atol=1e-5, rtol=0)


def test_layer_mask_is_none_without_padding_or_a_cutting_window():
    dev = torch.device("cpu")
    assert blocks.layer_mask(None, None, 16, dev) is None
    assert blocks.layer_mask(None, 16, 16, dev) is None
    cut = blocks.layer_mask(None, 4, 6, dev)
    assert cut.shape == (1, 1, 6, 6)
    assert torch.equal(cut, blocks.causal_mask(torch.ones(1, 6, dtype=torch.bool), 4))
    padding = torch.tensor([[False, True, True]])
    assert torch.equal(blocks.layer_mask(padding, None, 3, dev), blocks.causal_mask(padding))


def test_the_inputs_drop_a_mask_that_pads_nothing():
    """The one read of the padding, per batch where the inputs are made: all real → None."""
    spec = load_model(hf("llama"))
    ids = _ids(spec, 2, 8)
    assert spec.text_inputs(ids, torch.ones(2, 8, dtype=torch.long))["attention_mask"] is None
    padding = torch.ones(2, 8, dtype=torch.long)
    padding[0, 0] = 0
    mask = spec.text_inputs(ids, padding)["attention_mask"]
    assert mask.dtype == torch.bool and torch.equal(mask, padding.bool())
    with pytest.raises(BrigadeError, match=r"padding mask of shape \(2, 7\) for token ids of shape \(2, 8\)"):
        spec.text_inputs(ids, padding[:, :7])


@pytest.mark.cuda  # the flash kernel needs a CUDA GPU: the GPU tier (tests/conftest.py)
@pytest.mark.parametrize("family", FAMILIES)
def test_on_a_gpu_the_flash_kernel_takes_a_batch_without_padding(family):
    """Only the flash kernel allowed: an explicit mask would find no kernel and raise."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    spec = load_model(hf(family), block_size=16)
    model = whole(spec.blocks).eval().to("cuda", torch.bfloat16)

    def to_gpu(v):  # the rotary (cos, sin) in the model's dtype, as transformers' rotary gives them
        return tuple(x.to("cuda", torch.bfloat16) for x in v) if isinstance(v, tuple) else \
            None if v is None else v.cuda()

    inputs = {k: to_gpu(v) for k, v in spec.text_inputs(_ids(spec)).items()}
    with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        assert model(inputs).isfinite().all()
