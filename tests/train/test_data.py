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
    assert set(x) == {"input_ids", "attention_mask", "position_embeddings"} and y.shape == (2, 64)
    assert torch.equal(x["input_ids"][:, 1:], y[:, :-1]) and len(built.train) > 1000
    assert (tmp_path / "run" / "tokens" / "manifest.json").is_file()  # tokenized into the run's cache
