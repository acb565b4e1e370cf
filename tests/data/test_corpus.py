"""brigade.data.corpus: the documents of every format a corpus comes in, a piece at a time."""

import pytest

from brigade.data import corpus
from brigade.data.corpus import Piece, find_sources, read_pieces
from brigade.errors import BrigadeError
from tests.data.words import write_jsonl


def pieces(*paths, field="text"):
    return [p for s in find_sources([str(p) for p in paths]) for p in read_pieces(s, field, lambda n: None)]


def texts(*paths, **kw):
    return [p.text for p in pieces(*paths, **kw)]


def test_plain_text_is_one_document(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("\ufeffa b\nc d\n\ne")
    got = pieces(f)
    assert "".join(p.text for p in got) == "a b\nc d\n\ne"  # the byte-order mark left out
    assert [p.starts_document for p in got] == [True] + [False] * (len(got) - 1)


def test_an_empty_text_file_is_no_document(tmp_path):
    (tmp_path / "e.txt").write_text("\n \n")
    assert pieces(tmp_path / "e.txt") == []


def test_a_long_text_file_comes_in_pieces_cut_after_a_newline(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "PIECE_CHARS", 10)
    f = tmp_path / "t.txt"
    f.write_text("a b c d e\nf g h\na b c d e f\nlast")
    got = pieces(f)
    assert "".join(p.text for p in got) == f.read_text()
    assert [p.starts_document for p in got] == [True] + [False] * (len(got) - 1)  # one document
    assert len(got) > 2 and all(p.text.endswith("\n") for p in got[:-1])
    assert max(len(p.text) for p in got) <= 4 * 10


def test_jsonl_is_one_document_per_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"text": "a b", "id": 1}, "", "   ", {"text": "c\u2028d"}, {"text": ""}, {"text": "e"}])
    # blank lines and empty texts are skipped; U+2028 inside a string does not split a line
    assert texts(path) == ["a b", "c\u2028d", "e"]


def test_json_suffix_is_json_lines_and_field_is_chosen(tmp_path):
    path = write_jsonl(tmp_path / "d.json", [{"body": "a"}, {"body": "b c"}])
    assert texts(path, field="body") == ["a", "b c"]


def test_a_folder_is_its_files_in_sorted_order_hidden_ones_left_out(tmp_path):
    (tmp_path / "c" / "sub").mkdir(parents=True)
    (tmp_path / "c" / "b.txt").write_text("second")
    (tmp_path / "c" / "a.txt").write_text("first")
    (tmp_path / "c" / "sub" / "z.jsonl").write_text('{"text": "third"}\n')
    (tmp_path / "c" / ".hidden.txt").write_text("never")
    assert texts(tmp_path / "c") == ["first", "second", "third"]


def test_parquet_rows_are_documents(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": [1, 2, 3], "body": ["a b", "", "c"]}), tmp_path / "d.parquet")
    assert texts(tmp_path / "d.parquet", field="body") == ["a b", "c"]
    with pytest.raises(BrigadeError, match=r"has no column 'text' \(its columns: id, body\): give --field"):
        texts(tmp_path / "d.parquet")


def test_a_datasets_folder_is_read_in_its_own_order(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["one", "two", "three"]}).save_to_disk(str(tmp_path / "ds"),
                                                                              num_shards=2)
    assert texts(tmp_path / "ds") == ["one", "two", "three"]


def test_prompt_and_completion_count_the_completion_only(tmp_path):
    path = write_jsonl(tmp_path / "i.jsonl", [{"prompt": "a b", "completion": "c"}])
    assert pieces(path) == [Piece("a b", loss=False), Piece("c", loss=True, starts_document=False)]


@pytest.mark.parametrize("content,message", [
    (b"\x00\x01\x02binary", "looks binary"), (b"ok\n\xff\xfe text", "is not UTF-8 text \\(byte 3\\)"),
])
def test_bad_text_files(tmp_path, content, message):
    f = tmp_path / "d.txt"
    f.write_bytes(content)
    with pytest.raises(BrigadeError, match=message) as e:
        pieces(f)
    assert "\n" not in str(e.value)


def test_missing_corpus_and_empty_folder(tmp_path):
    with pytest.raises(BrigadeError, match="not found"):
        pieces(tmp_path / "nope.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BrigadeError, match="has no files"):
        pieces(tmp_path / "empty")


def test_bad_json_line_names_its_line_number(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, "", '{"text": "b"', {"text": "c"}])
    with pytest.raises(BrigadeError, match=r"d\.jsonl' line 3 is not valid JSON .*each line must be"):
        pieces(path)


def test_line_that_is_not_an_object(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, ["b"]])
    with pytest.raises(BrigadeError, match="line 2 is a JSON list, not an object"):
        pieces(path)


@pytest.mark.parametrize("row", [{"content": "a"}, {"text": 7}, {"text": None}, {"prompt": "a"}])
def test_missing_or_non_string_text_field(tmp_path, row):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, {"text": "b"}, row])
    with pytest.raises(BrigadeError, match=r"line 3 has no string field 'text' \(nor 'messages', nor "
                                           r"'prompt' and 'completion'\)"):
        pieces(path)


def test_the_same_files_have_the_same_fingerprint_and_a_touched_one_another(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("a")
    before = find_sources([str(f)])[0].fingerprint()
    assert find_sources([str(f)])[0].fingerprint() == before
    f.write_text("ab")
    assert find_sources([str(f)])[0].fingerprint() != before
