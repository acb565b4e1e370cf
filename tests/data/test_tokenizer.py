"""brigade.data.tokenizer: a model directory's tokenizer, its end-of-sequence token, its hash."""

import sys

import pytest

from brigade.data.tokenizer import find_eos, load_tokenizer, tokenizer_sha256
from brigade.errors import BrigadeError
from tests.data.words import save_tokenizer


@pytest.fixture
def model_dir(tmp_path):
    return save_tokenizer(tmp_path / "model")


# --- tokenizer --------------------------------------------------------------------------------

def test_load_tokenizer_reads_tokenizer_json(model_dir):
    tok = load_tokenizer(model_dir)
    assert tok.encode("a b h", add_special_tokens=False).ids == [3, 4, 10]
    assert find_eos(tok) == 0


def test_find_eos_tries_common_tokens_and_may_find_none(tmp_path):
    gpt2_like = load_tokenizer(save_tokenizer(tmp_path / "g", ["[UNK]", "a", "<|endoftext|>"]))
    assert find_eos(gpt2_like) == 2
    plain = load_tokenizer(save_tokenizer(tmp_path / "p", ["[UNK]", "a", "b"]))
    assert find_eos(plain) is None


def test_missing_tokenizer_json_says_how_to_write_it(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(BrigadeError, match=r"tokenizer\.json' not found.*save_pretrained") as e:
        load_tokenizer(str(tmp_path / "empty"))
    assert "\n" not in str(e.value)


def test_missing_model_directory(tmp_path):
    with pytest.raises(BrigadeError, match="model directory .*nope.* not found"):
        load_tokenizer(str(tmp_path / "nope"))


def test_unreadable_tokenizer_json_gives_the_cause(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(BrigadeError, match=r"not a tokenizer file .*\(.*line 1.*\).*save_pretrained") as e:
        load_tokenizer(str(tmp_path))
    assert "\n" not in str(e.value)


def test_missing_tokenizers_package_says_what_to_install(model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(BrigadeError, match=r"pip install -e '\.\[hf\]'"):
        load_tokenizer(model_dir)


def test_the_hash_is_the_tokenizer_files_bytes(tmp_path):
    a = save_tokenizer(tmp_path / "a")
    b = save_tokenizer(tmp_path / "b")
    c = save_tokenizer(tmp_path / "c", ["[UNK]", "a", "b"])
    assert tokenizer_sha256(a) == tokenizer_sha256(b) != tokenizer_sha256(c)
