import pytest
import torch

from brigade.errors import BrigadeError
from brigade.train.data import CharDataset, Sampler, Vocab, default_corpus, load_text_data, read_text


def test_default_corpus_is_python_docs():
    text = default_corpus()
    assert len(text) > 400_000 and "lambda" in text


@pytest.mark.parametrize("content,message", [
    (b"", "is empty"), (b"  \n", "is empty"),
    (b"\x00\x01\x02binary", "looks binary"), (b"\xff\xfe\xfa text", "is not UTF-8"),
])
def test_bad_data_files(tmp_path, content, message):
    f = tmp_path / "d.txt"
    f.write_bytes(content)
    with pytest.raises(BrigadeError, match=message):
        read_text(str(f))


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(BrigadeError, match="not found"):
        read_text(str(tmp_path / "nope.txt"))
    with pytest.raises(BrigadeError, match="is a directory"):
        read_text(str(tmp_path))


def test_corpus_shorter_than_a_block(tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("hello world")
    with pytest.raises(BrigadeError, match="fewer than one block of 64"):
        load_text_data(str(f), 64, 0.1)


def test_split_is_deterministic_and_windows_shift_by_one(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("abcdefghij" * 50)
    vocab, train, val = load_text_data(str(f), 8, 0.2)
    assert len(vocab) == 10 and len(train) == 400 - 8 and len(val) == 100 - 8
    x, y = train.batch(torch.tensor([0, 3]))
    assert vocab.decode(x[0]) == "abcdefgh" and vocab.decode(y[0]) == "bcdefghi"
    assert vocab.decode(x[1]) == "defghijab"[:8]


def test_vocab_rejects_unknown_characters():
    with pytest.raises(BrigadeError, match="not in the run's vocabulary"):
        Vocab("ab").encode("abc")


def test_sampler_is_deterministic_and_resumable():
    a = Sampler(100, 8, seed=1)
    first = [a.next_global() for _ in range(30)]  # crosses two epoch boundaries
    b = Sampler(100, 8, seed=1, cursor=8 * 17)
    assert all(torch.equal(x, y) for x, y in zip(first[17:], [b.next_global() for _ in range(13)]))
    assert a.epoch == 2
    epoch0 = torch.cat(first[:13])[:100]
    assert sorted(epoch0.tolist()) == list(range(100))  # a permutation per epoch


def test_shards_do_not_depend_on_dp():
    batch = Sampler(1000, 12, seed=0).next_global()
    for dp in (1, 2, 3, 4):
        assert torch.equal(torch.cat([Sampler.shard(batch, r, dp) for r in range(dp)]), batch)


def test_dataset_needs_one_block():
    with pytest.raises(BrigadeError, match="fewer than one block"):
        CharDataset(torch.zeros(5, dtype=torch.long), 8)


def test_an_hf_model_without_data_trains_on_the_built_in_corpus_in_its_tokens():
    """`build` for hf:DIR: blocks without memory (each rank fills its own), the corpus tokenized
    by the directory's tokenizer, the inputs the blocks take, and the weights' loader."""
    pytest.importorskip("transformers")
    import torch

    from brigade.config import RunConfig
    from brigade.train.data import build
    from tests.models.hf.dirs import hf

    cfg = RunConfig()
    cfg.model.model, cfg.data.block_size = hf("llama"), 64
    built = build(cfg)
    assert built.weights is not None and built.vocab is None
    assert all(p.is_meta for b in built.blocks for p in b.parameters())
    x, y = built.train.batch(torch.arange(2))
    assert set(x) == {"input_ids", "attention_mask", "position_embeddings"} and y.shape == (2, 64)
    assert torch.equal(x["input_ids"][:, 1:], y[:, :-1]) and len(built.train) > 1000
