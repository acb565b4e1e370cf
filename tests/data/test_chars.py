"""brigade.data.chars: the built-in GPT's characters and its split."""

import pytest
import torch

from brigade.data.chars import Vocab, load_text_data
from brigade.errors import BrigadeError


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
