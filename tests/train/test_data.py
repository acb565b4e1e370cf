"""brigade.train.data: what a run trains (its data itself: tests/data/)."""

import pytest


def test_an_hf_model_without_data_trains_on_the_built_in_corpus_in_its_tokens(tmp_path):
    """`build` for hf:DIR: blocks without memory (each rank fills its own), the corpus tokenized
    by the directory's tokenizer, the inputs the blocks take, and the weights' loader."""
    pytest.importorskip("transformers")
    import torch

    from brigade.config import RunConfig
    from brigade.train.data import build
    from tests.models.hf.dirs import hf

    cfg = RunConfig()
    cfg.model.model, cfg.data.block_size, cfg.train.out = hf("llama"), 64, str(tmp_path / "run")
    built = build(cfg)
    assert built.weights is not None and built.vocab is None
    assert all(p.is_meta for b in built.blocks for p in b.parameters())
    x, y = built.train.batch(torch.arange(2))
    assert set(x) == {"input_ids", "attention_mask", "position_embeddings", "documents"}
    assert y.shape == (2, 64)
    assert x["documents"] is None  # the built-in corpus is one document
    assert torch.equal(x["input_ids"][:, 1:], y[:, :-1]) and len(built.train) > 1000
    assert (tmp_path / "run" / "tokens" / "manifest.json").is_file()  # tokenized into the run's cache


def test_an_hf_model_on_a_corpus_of_documents_packs_them_apart_unless_told(tmp_path):
    """Windows that cross a document start hand the blocks their documents and the rotary
    restarted positions (`models.documents`); --no-document-mask hands none: one causal row."""
    pytest.importorskip("transformers")
    import json

    import torch

    from brigade.config import RunConfig
    from brigade.models.documents import positions
    from brigade.train.data import build
    from tests.models.hf.dirs import hf

    corpus = tmp_path / "docs.jsonl"
    rows = (json.dumps({"text": f"note {k}: " + "x" * (k % 13)}) for k in range(300))
    corpus.write_text("".join(row + "\n" for row in rows))
    cfg = RunConfig()
    cfg.model.model, cfg.data.data, cfg.data.block_size = hf("llama"), str(corpus), 32
    cfg.train.out = str(tmp_path / "run")
    x, _ = build(cfg).train.batch(torch.arange(4))
    assert x["documents"] is not None and int(x["documents"].max()) >= 1
    cos = x["position_embeddings"][0]  # (B, T, D)
    starts = positions(x["documents"]) == 0
    assert torch.equal(cos[starts], cos[:, :1].expand_as(cos)[starts])  # each start at position 0
    cfg.data.document_mask = False
    x, _ = build(cfg).train.batch(torch.arange(4))
    assert x["documents"] is None
