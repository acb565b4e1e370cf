"""Document-aware packing (`brigade.models.documents`): a packed batch's loss and gradients are
the documents' own, computed one by one; the mask, positions and the flex path's mask agree."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from brigade.models import documents as docs
from brigade.models import load_model
from brigade.models.gpt import GPTConfig
from brigade.pipeline.stages.side_inputs import whole

ROWS = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2], [0] * 5 + [1] * 7])


def test_positions_restart_and_the_mask_stays_within_each_document():
    assert docs.positions(ROWS).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4],
                                            [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]]
    m = docs.block_causal(ROWS)
    assert m.shape == (2, 1, 12, 12)
    assert m[0, 0, 4].tolist() == [False] * 3 + [True, True] + [False] * 7  # document 1, keys ≤ 4
    assert docs.packed(torch.zeros(2, 12, dtype=torch.int64)) is None  # one a row: plain causal
    assert docs.packed(ROWS) is ROWS


@pytest.mark.full
def test_the_flex_block_mask_is_the_boolean_one():
    """FlexAttention (the GPU's path) on its CPU forward, eager: no backward here, so no
    gradients (importing it costs seconds: the full tier's)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 12, 8, generator=g) for _ in range(3))

    def same(b, h, qi, ki):
        return (ROWS[b, qi] == ROWS[b, ki]) & (ki <= qi)

    mask = flex.create_block_mask(same, 2, None, 12, 12, device="cpu")
    with warnings.catch_warnings():  # eager flex says it is meant to be compiled: here it is the point
        warnings.simplefilter("ignore", UserWarning)
        got = flex.flex_attention(q, k, v, block_mask=mask)
    torch.testing.assert_close(got, docs.attend(q, k, v, ROWS), atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_the_compiled_flex_path_is_the_masks_attention():
    """`attend`'s CUDA path, compiled, run on this CPU's forward (10-20 s to compile): the block
    mask made once for every layer given the same documents."""
    rows = torch.cat([ROWS] * 11, dim=1).sort(dim=1).values  # 132 positions: more than one tile
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 132, 16, generator=g) for _ in range(3))
    with torch.no_grad():
        first = docs._flex(q, k, v, rows)
        mask = docs._FLEX["mask"][1]
        again = docs._flex(q, k, v, rows)
    assert docs._FLEX["mask"][1] is mask
    torch.testing.assert_close(first, docs.attend(q, k, v, rows), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(again, first)


def _one_by_one(model, ids: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor, make) -> torch.Tensor:
    """The mean loss over every token, each document run alone from its first token in the row."""
    total, count = 0.0, 0
    for b in range(ids.shape[0]):
        for d in rows[b].unique().tolist():
            at = (rows[b] == d).nonzero().flatten()
            x, y = ids[b:b + 1, at], targets[b:b + 1, at]
            logits = model(make(x))
            total = total + F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
            count += y.numel()
    return total / count


def _compare(spec, make_packed, make_alone):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(60, (2, 12), generator=g)
    targets = torch.randint(60, (2, 12), generator=g)
    packed_model = whole(spec.blocks).eval()
    alone_model = copy.deepcopy(packed_model)
    packed_loss = spec.loss_fn(packed_model(make_packed(ids, ROWS)), targets)
    alone_loss = _one_by_one(alone_model, ids, targets, ROWS, make_alone)
    packed_loss.backward()
    alone_loss.backward()
    torch.testing.assert_close(packed_loss, alone_loss, atol=1e-6, rtol=1e-6)
    for (name, a), b in zip(packed_model.named_parameters(), alone_model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=name)
    # without the documents the same rows attend across them: a test that could not fail would not
    with torch.no_grad():
        plain = spec.loss_fn(packed_model(make_packed(ids, torch.zeros_like(ROWS))), targets)
    assert abs(plain.item() - alone_loss.item()) > 1e-4


def test_a_packed_gpt_batch_has_the_documents_own_loss_and_gradients():
    cfg = GPTConfig(vocab_size=60, block_size=12, n_layer=2, n_head=2, n_embd=16, tie_embeddings=False)
    spec = load_model("gpt", seed=0, gpt_cfg=cfg, documents=True)
    _compare(spec, lambda x, rows: {"idx": x, "documents": rows},
             lambda x: {"idx": x, "documents": torch.zeros_like(x)})


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_packed_hugging_face_batch_has_the_documents_own_loss_and_gradients(family):
    from tests.models.hf.dirs import hf

    spec = load_model(hf(family), seed=0, documents=True)  # the directories the other tests write
    _compare(spec, lambda x, rows: spec.hf.inputs(x, documents=rows), lambda x: spec.hf.inputs(x))


def test_the_synthetic_batches_pack_documents_when_asked():
    cfg = GPTConfig(vocab_size=60, block_size=16, n_layer=1, n_head=2, n_embd=16)
    x, _ = load_model("gpt", gpt_cfg=cfg, documents=True).make_batch(8, torch.Generator().manual_seed(0))
    assert set(x) == {"idx", "documents"} and x["documents"].shape == (8, 16)
    assert int(x["documents"].max()) >= 1 and (x["documents"][:, 0] == 0).all()
