"""brigade.data.chars: the built-in GPT's characters and its split."""

import subprocess
import sys

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
    with pytest.raises(BrigadeError, match="not in the run's vocabulary: 'cé🙂'"):
        Vocab("ab").encode("abcé🙂")
    with pytest.raises(BrigadeError, match="not in the run's vocabulary: 'x'"):
        Vocab("").encode("x")


@pytest.mark.parametrize("chars", ["", "\n ab", "ba", "\té€🙂z"])
def test_each_character_is_its_index_in_the_vocabulary(chars):
    """encode searches code points over tensors; it must give what the plain lookup gives, for
    characters of one to four UTF-8 bytes and for a vocabulary not in sorted order."""
    text = (chars * 7)[::-1] + chars
    ids = Vocab(chars).encode(text)
    assert ids.dtype == torch.long
    assert ids.tolist() == [chars.index(c) for c in text]
    assert Vocab(chars).decode(ids) == text


def test_a_held_out_text_validates_and_all_of_the_training_text_trains(tmp_path):
    text, held = tmp_path / "t.txt", tmp_path / "held.txt"
    text.write_text("abcdefghij" * 50)
    held.write_text("jihgfedcba" * 3)
    vocab, train, val = load_text_data(str(text), 8, 0.2, str(held))
    assert len(train) == 500 - 8 and len(val) == 30 - 8  # --val-fraction no longer cuts the text
    x, _ = val.batch(torch.tensor([0]))
    assert vocab.decode(x[0]) == "jihgfedc"


@pytest.mark.parametrize("held,message", [
    ("abcxyz" * 10, "--val-data '{path}' has 3 character(s) the training text lacks ('xyz'): the model knows "
                    "only its training text's characters; hold out text written in them"),
    ("abc", "the held-out text '{path}' (--val-data) has 3 characters, fewer than one block of 8 + 1"),
])
def test_a_held_out_text_the_model_cannot_read_is_one_line(tmp_path, held, message):
    text, path = tmp_path / "t.txt", tmp_path / "held.txt"
    text.write_text("abcdefghij" * 50)
    path.write_text(held)
    with pytest.raises(BrigadeError) as refused:
        load_text_data(str(text), 8, 0.2, str(path))
    assert message.format(path=path) in str(refused.value) and "\n" not in str(refused.value)


_FORK_AFTER_ENCODE = """
import os, torch
from brigade.data.chars import Vocab
text = "abcdefgh" * 100_000
Vocab.of(text).encode(text)
pid = os.fork()
if pid == 0:
    torch.set_num_threads(2)
    torch.arange(10**6, dtype=torch.int32).long()  # long enough to run on OpenMP's threads
    os._exit(0)
_, status = os.waitpid(pid, 0)
raise SystemExit(os.waitstatus_to_exitcode(status))
"""


def test_a_process_forked_after_encoding_runs_parallel_ops():
    """The agent encodes before it forks its workers; a torch op of a whole text would have run
    on OpenMP's threads there, and a forked worker's first parallel op then waits for ever (GNU
    OpenMP is not fork-safe: `brigade train --threads 2` hung so). In a fresh interpreter, since
    a parallel op of the test process itself would hang the child whatever encode does."""
    done = subprocess.run([sys.executable, "-c", _FORK_AFTER_ENCODE], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
