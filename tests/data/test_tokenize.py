"""brigade.data.tokenize: a corpus into a shard set, once; brigade.data.shards: read back."""

import json

import numpy as np
import pytest
import torch

from brigade.data import tokenize as tk
from brigade.data.sampler import Sampler
from brigade.data.shards import IGNORE, ShardManifest, ShardSet, TokenWindows, split
from brigade.data.tokenize import TokenizeConfig, tokenize
from brigade.data.tokenizer import tokenizer_sha256
from brigade.errors import BrigadeError
from tests.data.words import ids, save_tokenizer, write_jsonl


@pytest.fixture
def model_dir(tmp_path):
    return save_tokenizer(tmp_path / "model")


def run(tmp_path, model_dir, *corpus, out="shards", lines=None, **kw):
    said = [] if lines is None else lines
    cfg = TokenizeConfig(corpus=[str(c) for c in corpus], model=f"hf:{model_dir}",
                         out=str(tmp_path / out), **kw)
    return tokenize(cfg, progress=False, say=said.append), tmp_path / out


def stream(folder) -> list[int]:
    shards = ShardSet.open(folder)
    return shards.read(0, len(shards)).tolist()


def test_documents_are_packed_with_eos_between_them_only(tmp_path, model_dir):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a b c d"}, {"text": "e f"}, {"text": "g h a b"}])
    m, out = run(tmp_path, model_dir, path)
    assert stream(out) == ids("a b c d </s> e f </s> g h a b")  # no <s>, no trailing </s>
    assert (m.tokens, m.documents, m.dtype, m.eos, m.max_id) == (12, 3, "uint16", 0, 10)
    assert np.fromfile(out / "documents.bin", dtype="<u8").tolist() == [0, 5, 8]
    assert not m.masked and not list(out.glob("mask-*"))  # every token counted: no masks kept
    assert m.tokenizer_sha256 == tokenizer_sha256(model_dir)


def test_windows_tile_the_stream_across_shard_files(tmp_path, model_dir):
    f = tmp_path / "t.txt"
    f.write_text("a b c d e f g h a b c d e f g h a b c")
    m, out = run(tmp_path, model_dir, f, shard_tokens=4)
    assert [s["tokens"] for s in m.shards] == [4, 4, 4, 4, 3]
    shards = ShardSet.open(out)
    train, val = split(shards, block_size=3, val_fraction=0.25)
    assert len(train) == 4 and len(val) == 1  # the cut at int(19 * 0.75) = 14
    x, y = train.batch(torch.tensor([1, 3]))  # windows 3..6 and 9..12 cross files
    assert x.tolist() == [ids("d e f"), ids("b c d")] and y.tolist() == [ids("e f g"), ids("c d e")]
    every = train.batch(Sampler(len(train), len(train), seed=0).next_global())[0]
    assert sorted(every.flatten().tolist()) == sorted(stream(out)[:12])  # each id an input once


def test_windows_say_where_their_documents_start_and_a_mixture_keeps_them(tmp_path, model_dir):
    """Documents at 0, 5, 8 of "a b c d </s> e f </s> g h a b": each input token's document counted
    from 0 at its window's first, the end-of-sequence token with the document it ends."""
    from brigade.data.mix import Mixture

    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a b c d"}, {"text": "e f"}, {"text": "g h a b"}])
    _, out = run(tmp_path, model_dir, path, shard_tokens=5)
    shards = ShardSet.open(out)
    windows = TokenWindows(shards, 0, len(shards), 3, "--data", documents=True)
    x, y, docs = windows.batch(torch.tensor([0, 1, 2]))  # windows from 0, 3 and 6
    assert x.tolist() == [ids("a b c"), ids("d </s> e"), ids("f </s> g")]
    assert docs.tolist() == [[0, 0, 0], [0, 0, 1], [0, 0, 1]]
    assert len(TokenWindows(shards, 0, len(shards), 3, "--data").batch(torch.tensor([0]))) == 2  # off
    mixed = Mixture([windows, windows], [1, 1]).batch(torch.tensor([1, 2]))
    assert len(mixed) == 3 and mixed[2].shape == (2, 3)


def test_a_truncated_documents_file_is_refused_in_one_line(tmp_path, model_dir):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a b c d"}, {"text": "e f"}])
    _, out = run(tmp_path, model_dir, path)
    (out / "documents.bin").write_bytes(b"\0" * 8)
    with pytest.raises(BrigadeError, match=r"documents.bin' has 8 bytes where its manifest says 16"):
        ShardSet.open(out)


def test_prompt_and_completion_mask_the_prompt_out_of_the_targets(tmp_path, model_dir):
    path = write_jsonl(tmp_path / "i.jsonl", [{"prompt": "a b", "completion": "c d"},
                                              {"prompt": "e", "completion": "f g"}])
    m, out = run(tmp_path, model_dir, path)
    assert m.masked and stream(out) == ids("a b c d </s> e f g")
    shards = ShardSet.open(out)
    assert shards.read(0, 8, mask=True).tolist() == [0, 0, 1, 1, 1, 0, 1, 1]  # </s> after an answer counts
    x, y = TokenWindows(shards, 0, 8, 7, "all").batch(torch.tensor([0]))
    assert x.tolist() == [ids("a b c d </s> e f")]
    assert y.tolist() == [[IGNORE, *ids("c d </s>"), IGNORE, *ids("f g")]]  # b and e: prompts


def test_chat_messages_count_the_assistant_turns_only(tmp_path):
    pytest.importorskip("transformers")
    model = save_tokenizer(tmp_path / "chat", chat=True)
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [
        {"role": "user", "content": "a b"}, {"role": "assistant", "content": "c"},
        {"role": "user", "content": "d"}, {"role": "assistant", "content": "e f"}]}])
    m, out = run(tmp_path, model, path)
    shards = ShardSet.open(out)
    tokens = [shards.read(i, i + 1).item() for i in range(len(shards))]
    counted = shards.read(0, len(shards), mask=True).tolist()
    from tokenizers import Tokenizer

    words = Tokenizer.from_file(f"{model}/tokenizer.json").decode(tokens, skip_special_tokens=False).split()
    kept = [w for w, c in zip(words, counted) if c]
    assert words == "<s> user a b </s> <s> assistant c </s> <s> user d </s> <s> assistant e f </s>".split()
    assert kept == ["c", "</s>", "e", "f", "</s>"]  # the answers and the ends of the answers


def test_again_on_the_same_inputs_writes_nothing(tmp_path, model_dir):
    f = tmp_path / "t.txt"
    f.write_text("a b c d e f g h")
    first, out = run(tmp_path, model_dir, f)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    said = []
    again, _ = run(tmp_path, model_dir, f, lines=said)
    assert again == first and {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert said == [f"brigade tokenize: {out} is up to date (8 tokens, 1 documents)"]


def test_a_changed_input_is_tokenized_again(tmp_path, model_dir):
    f = tmp_path / "t.txt"
    f.write_text("a b c d e f g h")
    run(tmp_path, model_dir, f)
    f.write_text("h g f e d c b a a")
    _, out = run(tmp_path, model_dir, f)
    assert stream(out) == ids("h g f e d c b a a")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # nothing left over


def test_a_shard_failing_its_checksum_is_named_and_written_again(tmp_path, model_dir):
    f = tmp_path / "t.txt"
    f.write_text("a b c d e f g h")
    _, out = run(tmp_path, model_dir, f, shard_tokens=4)
    (out / "tokens-00001.bin").write_bytes(np.array(ids("a a a a"), "<u2").tobytes())  # same size
    said = []
    run(tmp_path, model_dir, f, shard_tokens=4, lines=said)
    assert said == [f"brigade tokenize: tokens-00001.bin in {out} fails its checksum: tokenizing again"]
    assert stream(out) == ids("a b c d e f g h")


def test_a_truncated_shard_is_refused_in_one_line(tmp_path, model_dir):
    f = tmp_path / "t.txt"
    f.write_text("a b c d e f g h")
    _, out = run(tmp_path, model_dir, f, shard_tokens=4)
    (out / "tokens-00001.bin").write_bytes(b"\x03\x00")
    with pytest.raises(BrigadeError, match=r"tokens-00001.bin' has 2 bytes where its manifest says 8 "
                                           r"\(truncated or damaged\): run brigade tokenize again"):
        ShardSet.open(out)


def test_shards_of_another_tokenizer_are_refused(tmp_path, model_dir):
    f = tmp_path / "t.txt"
    f.write_text("a b c d")
    _, out = run(tmp_path, model_dir, f)
    other = save_tokenizer(tmp_path / "other", ["[UNK]", "a", "b", "c", "d"])
    with pytest.raises(BrigadeError, match="were tokenized by another tokenizer .*: run brigade tokenize "
                                           "with this model"):
        ShardSet.open(out, tokenizer_sha256(other))


def test_a_corpus_without_text_leaves_nothing_behind(tmp_path, model_dir):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": ""}, {"text": ""}])
    with pytest.raises(BrigadeError, match="has no text: give files with text in them"):
        run(tmp_path, model_dir, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "model"]


def test_an_error_half_way_leaves_the_older_set_whole(tmp_path, model_dir, monkeypatch):
    f = tmp_path / "t.txt"
    f.write_text("a b c d")
    _, out = run(tmp_path, model_dir, f)
    bad = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, {"nope": 1}])
    with pytest.raises(BrigadeError, match="line 2 has no string field"):
        run(tmp_path, model_dir, f, bad)
    assert stream(out) == ids("a b c d")  # the finished set is still there, and whole
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_not_a_manifest_and_no_manifest(tmp_path):
    with pytest.raises(BrigadeError, match="has no manifest.json: it is not a finished token shard set"):
        ShardManifest.read(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(BrigadeError, match="is not a manifest brigade tokenize wrote"):
        ShardManifest.read(tmp_path)


def test_batches_of_text_are_bounded(tmp_path, model_dir, monkeypatch):
    """The corpus is encoded a batch at a time, never whole: the same stream either way."""
    monkeypatch.setattr(tk, "BATCH_CHARS", 4)  # "a b c d" fills one; "e f" and "g h a b" the next
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a b c d"}, {"text": "e f"}, {"text": "g h a b"}])
    calls = []
    real = tk._encode
    monkeypatch.setattr(tk, "_encode", lambda t, batch, *a: calls.append(len(batch)) or real(t, batch, *a))
    _, out = run(tmp_path, model_dir, path)
    assert calls == [1, 2] and stream(out) == ids("a b c d </s> e f </s> g h a b")


def test_model_must_be_a_directory_with_a_tokenizer(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("a")
    with pytest.raises(BrigadeError, match="give hf:DIR"):
        tokenize(TokenizeConfig(corpus=[str(f)], model="gpt", out=str(tmp_path / "o")), progress=False)


def test_a_set_another_machine_finished_first_is_kept(tmp_path, model_dir, monkeypatch):
    """Two machines sharing --out tokenize the same corpus: the one that finishes second keeps
    the first one's set instead of renaming it away under its readers."""
    import shutil

    f = tmp_path / "t.txt"
    f.write_text("a b c d e f g h")
    _, first = run(tmp_path, model_dir, f, out="first")
    real = tk._write

    def finishes_second(cfg, *args):
        manifest = real(cfg, *args)
        shutil.copytree(first, cfg.out)  # the other machine's set lands while this one writes
        return manifest

    monkeypatch.setattr(tk, "_write", finishes_second)
    _, out = run(tmp_path, model_dir, f)
    def stamps(folder):
        return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}

    assert stream(out) == ids("a b c d e f g h")
    assert stamps(out) == stamps(first)  # their files (copied with their times), not this one's
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
