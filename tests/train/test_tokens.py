import json
import sys

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from brigade.errors import BrigadeError
from brigade.train.data import Sampler
from brigade.train.tokens import (
    TokenDataset,
    find_eos,
    load_token_data,
    load_tokenizer,
    pack,
    read_documents,
)

WORDS = ["</s>", "<s>", "[UNK]", "a", "b", "c", "d", "e", "f", "g", "h"]
ID = {w: i for i, w in enumerate(WORDS)}  # "</s>" is 0, "a" is 3, ... "h" is 10


def save_tokenizer(directory, words=WORDS):
    """A word-level tokenizer with known ids; its post-processor wraps a text in <s> ... </s>,
    which the data must leave out (add_special_tokens=False)."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if "</s>" in words:
        tok.add_special_tokens(["</s>", "<s>"])
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 0)])
    directory.mkdir(exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return str(directory)


@pytest.fixture
def model_dir(tmp_path):
    return save_tokenizer(tmp_path / "model")


def ids(words: str) -> list[int]:
    return [ID[w] for w in words.split()]


def write_jsonl(path, rows):
    lines = [r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


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


# --- documents --------------------------------------------------------------------------------

def test_plain_text_is_one_document(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("a b\nc d\n\ne")
    assert read_documents(str(f)) == ["a b\nc d\n\ne"]


def test_jsonl_is_one_document_per_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"text": "a b", "id": 1}, "", "   ", {"text": "c\u2028d"}, {"text": ""}, {"text": "e"}])
    # blank lines and empty texts are skipped; U+2028 inside a string does not split a line
    assert read_documents(path) == ["a b", "c\u2028d", "e"]


def test_json_suffix_is_json_lines_and_field_is_chosen(tmp_path):
    path = write_jsonl(tmp_path / "d.json", [{"body": "a"}, {"body": "b c"}])
    assert read_documents(path, field="body") == ["a", "b c"]


def test_missing_data_file(tmp_path):
    with pytest.raises(BrigadeError, match="not found"):
        read_documents(str(tmp_path / "nope.jsonl"))


@pytest.mark.parametrize("name", ["e.txt", "e.jsonl"])
def test_empty_data_file(tmp_path, name):
    (tmp_path / name).write_text("\n \n")
    with pytest.raises(BrigadeError, match="is empty"):
        read_documents(str(tmp_path / name))


def test_bad_json_line_names_its_line_number(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, "", '{"text": "b"', {"text": "c"}])
    with pytest.raises(BrigadeError, match=r"d\.jsonl' line 3 is not valid JSON .*each line must be like"):
        read_documents(path)


def test_line_that_is_not_an_object(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, ["b"]])
    with pytest.raises(BrigadeError, match="line 2 is a JSON list, not an object"):
        read_documents(path)


@pytest.mark.parametrize("row", [{"content": "a"}, {"text": 7}, {"text": None}])
def test_missing_or_non_string_text_field(tmp_path, row):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, {"text": "b"}, row])
    with pytest.raises(BrigadeError, match=r"line 3 has no string field 'text': each line must be like "
                                           r"\{\"text\": \"\.\.\.\"\}"):
        read_documents(path)


def test_jsonl_without_any_text(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": ""}, {"text": ""}])
    with pytest.raises(BrigadeError, match="has no documents"):
        read_documents(path)


# --- packing and windows ----------------------------------------------------------------------

def test_pack_puts_eos_between_documents_only():
    assert pack([[3, 4], [5], [6, 7]], eos=0).tolist() == [3, 4, 0, 5, 0, 6, 7]
    assert pack([[3, 4], [5]], eos=None).tolist() == [3, 4, 5]
    assert pack([[3]], eos=0).dtype == torch.int64


def test_windows_tile_the_stream_and_targets_shift_by_one():
    data = TokenDataset(torch.arange(10), 3)
    assert len(data) == 3  # (10 - 1) // 3: windows start at 0, 3, 6
    x, y = data.batch(torch.tensor([2, 0, 1]))
    assert x.tolist() == [[6, 7, 8], [0, 1, 2], [3, 4, 5]]
    assert y.tolist() == [[7, 8, 9], [1, 2, 3], [4, 5, 6]]
    assert TokenDataset(torch.arange(9), 3).__len__() == 2  # 8 would need id 9 as a target


def test_every_example_can_be_sampled():
    data = TokenDataset(torch.arange(101), 4)
    x, y = data.batch(Sampler(len(data), len(data), seed=0).next_global())
    assert sorted(x.flatten().tolist()) == list(range(100))  # each id an input exactly once
    assert torch.equal(y, x + 1)


def test_fewer_tokens_than_one_sequence():
    with pytest.raises(BrigadeError, match="the training part of --data has 3 tokens, fewer than one "
                                           "sequence of 3 \\+ 1: use more text or a smaller --block-size"):
        TokenDataset(torch.arange(3), 3, "training part of --data")


# --- end to end -------------------------------------------------------------------------------

def test_load_jsonl_packs_and_splits_at_the_tail(tmp_path, model_dir):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a b c d"}, {"text": "e f"}, {"text": "g h a b"}])
    tok, train, val = load_token_data(path, model_dir, block_size=2, val_fraction=0.25)
    stream = ids("a b c d </s> e f </s> g h a b")  # no <s>, no trailing </s>
    assert torch.cat([train.ids, val.ids]).tolist() == stream
    assert train.ids.tolist() == stream[:9] and val.ids.tolist() == stream[9:]  # int(12 * 0.75)
    assert len(train) == 4 and len(val) == 1
    x, y = train.batch(torch.tensor([1, 2]))
    assert x.tolist() == [ids("c d"), ids("</s> e")] and y.tolist() == [ids("d </s>"), ids("e f")]
    assert tok.decode(val.batch(torch.tensor([0]))[0][0].tolist()) == "h a"


def test_load_plain_text_is_deterministic(tmp_path, model_dir):
    f = tmp_path / "t.txt"
    f.write_text("a b c d e f g h\n" * 5)
    first = load_token_data(str(f), model_dir, 3, 0.1)
    again = load_token_data(str(f), model_dir, 3, 0.1)
    assert first[1].ids.tolist() == ids("a b c d e f g h") * 4 + ids("a b c d")  # cut at int(40 * 0.9)
    assert first[2].ids.tolist() == ids("e f g h")
    assert torch.equal(first[1].ids, again[1].ids) and torch.equal(first[2].ids, again[2].ids)


def test_too_little_text_for_one_sequence(tmp_path, model_dir):
    f = tmp_path / "t.txt"
    f.write_text("a b c")
    with pytest.raises(BrigadeError, match=r"has 3 tokens, fewer than one sequence of 8 \+ 1.*--block-size"):
        load_token_data(str(f), model_dir, 8, 0.1)


def test_too_little_text_for_validation(tmp_path, model_dir):
    f = tmp_path / "t.txt"
    f.write_text("a b c d e f g h")
    with pytest.raises(BrigadeError, match="validation part of --data has 1 tokens"):
        load_token_data(str(f), model_dir, 4, 0.1)
