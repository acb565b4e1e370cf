"""A tokenized model's data (brigade/data/prepared.py): --data split at its last --val-fraction, or
all of it trained on beside a held-out corpus or shard set (--val-data)."""

import pytest
import torch

from brigade.data.prepared import VAL_CACHE, token_data
from brigade.data.text import default_corpus
from brigade.errors import BrigadeError
from tests.models.hf.dirs import tiny_dir


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("texts")
    corpus = default_corpus()
    (folder / "train.txt").write_text(corpus[:6000])
    (folder / "held.txt").write_text(corpus[20000:23000])
    return folder


def test_a_held_out_corpus_validates_and_all_of_data_trains(texts, tmp_path):
    directory = tiny_dir("llama")
    (shards,), train, _ = token_data(str(texts / "train.txt"), directory, 16, 0.1, str(tmp_path))
    _, whole, held = token_data(str(texts / "train.txt"), directory, 16, 0.1, str(tmp_path),
                                str(texts / "held.txt"))
    assert whole.hi == len(shards) and len(whole) > len(train)  # --val-fraction cuts nothing off
    assert held.shards.folder == tmp_path / VAL_CACHE  # tokenized apart from --data's cache
    x, y = held.batch(torch.tensor([0]))
    assert x.shape == y.shape == (1, 16) and held.hi == len(held.shards)  # every held-out token
    # a shard set given as --val-data is read as it is, not tokenized again
    _, _, again = token_data(str(texts / "train.txt"), directory, 16, 0.1, str(tmp_path / "b"),
                             str(tmp_path / VAL_CACHE))
    assert again.shards.folder == tmp_path / VAL_CACHE and len(again) == len(held)


def test_a_held_out_corpus_shorter_than_a_sequence_is_one_line(texts, tmp_path):
    (tmp_path / "tiny.txt").write_text("hi")
    with pytest.raises(BrigadeError, match=r"held-out set '.*tiny.txt' \(--val-data\) has \d+ tokens, fewer"):
        token_data(str(texts / "train.txt"), tiny_dir("llama"), 16, 0.1, str(tmp_path),
                   str(tmp_path / "tiny.txt"))


def test_corpora_mix_by_weight_each_tokenized_apart(texts, tmp_path):
    from brigade.data.mix import Mixture
    from brigade.data.prepared import content_sha256

    directory = tiny_dir("llama")
    spec = f"{texts / 'train.txt'}:3,{texts / 'held.txt'}:1"
    sets, train, val = token_data(spec, directory, 16, 0.1, str(tmp_path))
    assert [s.folder for s in sets] == [tmp_path / "tokens-0", tmp_path / "tokens-1"]
    assert isinstance(train, Mixture) and isinstance(val, Mixture)
    assert len(train) == sum(len(p) for p in train.parts)  # each corpus's training part
    corpus, _ = train.locate(torch.arange(1000))
    assert (corpus == 0).sum() == 750
    alone, _, _ = token_data(str(texts / "train.txt"), directory, 16, 0.1, str(tmp_path / "alone"))
    assert content_sha256(alone) == alone[0].manifest.content_sha256() != content_sha256(sets)
