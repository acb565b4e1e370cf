"""brigade.data.text: the built-in corpus, a checked UTF-8 file, windows of ids."""

import pytest
import torch

from brigade.data.text import CharDataset, default_corpus, read_text
from brigade.errors import BrigadeError


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


def test_dataset_needs_one_block():
    with pytest.raises(BrigadeError, match="fewer than one block"):
        CharDataset(torch.zeros(5, dtype=torch.long), 8)
