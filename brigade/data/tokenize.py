"""`brigade tokenize`: a corpus tokenized once, in bounded memory, into a shard set.

    corpus ─ corpus.read_pieces ─▶ batches of ~1 MiB of text ─ tokenizer.encode_batch_fast
           (a piece at a time)      (never the whole corpus)    (in parallel over the cores)
        ─▶ packed: end-of-sequence between documents ─ writer.ShardWriter ─▶ OUT.partial/
        ─▶ manifest.json last, then renamed to OUT: a set is there whole or not at all

Packing puts the tokenizer's end-of-sequence token between two documents (not after the last),
so the model sees where one text ends and the next begins:

    doc 0: a b c      doc 1: d e      stream: a b c </s> d e

Run again on the same inputs (the same files, sizes and modification times, tokenizer and
field), it checks every file's checksum and writes nothing; a file that fails it is named,
and the set is written anew.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from brigade.config.fielddoc import doc
from brigade.data.corpus import find_sources, read_pieces
from brigade.data.instruct import Chat
from brigade.data.piece import Piece
from brigade.data.shards import ShardManifest, dtype_for, failing_checksums, remove_tree
from brigade.data.tokenizer import find_eos, load_tokenizer, tokenizer_sha256
from brigade.data.writer import ShardWriter
from brigade.errors import BrigadeError

# Text encoded in one call: pieces enough for every core, and bounded memory (the library's
# encodings take some 250 bytes a character while they last: about 260 MB for 1 MiB).
BATCH_CHARS = 1 << 20


@dataclass
class TokenizeConfig:
    """`brigade tokenize CORPUS... --model hf:DIR --out DIR`."""

    corpus: list[str] = doc(help="text files, JSON Lines, Parquet files, datasets' save_to_disk "
                                 "folders, or folders of them", factory=list)
    model: str = doc("", "hf:DIR whose tokenizer.json tokenizes the corpus: the model you will "
                         "train on the shards")
    out: str = doc("", "folder for the shards and their manifest.json (train with --data OUT)")
    field: str = doc("text", "the field (JSON Lines) or column (Parquet, datasets) that holds a "
                             "document's text")
    shard_tokens: int = doc(1 << 28, "tokens per shard file at most")


@dataclass
class _Stream:
    """Where packing stands: whether a document came before, and whether its last piece was
    counted (the end-of-sequence token after it is a target the loss counts when it was)."""

    started: bool = False
    last_counted: bool = True
    max_id: int = 0


def tokenize(cfg: TokenizeConfig, progress: bool = True, verify: bool = True,
             say: Callable[[str], None] = print) -> ShardManifest:
    """Tokenize `cfg.corpus` into `cfg.out`, or find it done already.

    Args:
        progress: show a progress bar (bytes of the corpus).
        verify: when the set is up to date, check every file's checksum (reads it all); False:
            its sizes only (what a run checks at its start).

    Raises:
        BrigadeError: as `corpus.read_pieces` and `tokenizer.load_tokenizer`; a corpus with no
            text; --out that is a file.
    """
    directory = _directory(cfg.model)
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise BrigadeError(f"--out {cfg.out!r} is a file: give a folder for the shard set")
    sources = find_sources(cfg.corpus)
    wanted = {"tokenizer_sha256": tokenizer_sha256(directory), "options": {"field": cfg.field},
              "sources": [s.fingerprint() for s in sources]}
    done = _up_to_date(out, wanted, verify, say)
    if done is not None:
        return done
    had_a_set = (out / "manifest.json").is_file()
    tokenizer = load_tokenizer(directory)
    partial = out.parent / f".{out.name}.{socket.gethostname()}.{os.getpid()}.partial"
    remove_tree(partial)
    partial.mkdir(parents=True)
    try:
        manifest = _write(cfg, sources, tokenizer, wanted, directory, partial, progress)
    except BaseException:
        remove_tree(partial)
        raise
    done = None if had_a_set else _up_to_date(out, wanted, False, lambda line: None)
    if done is not None:  # another machine finished the same set first (one --out, shared)
        remove_tree(partial)
        return done
    _put_in_place(partial, out)
    return manifest


def _directory(model: str) -> str:
    if not model.startswith("hf:"):
        raise BrigadeError(f"--model {model!r}: give hf:DIR, the Hugging Face directory whose "
                           "tokenizer.json tokenizes the corpus")
    return model[3:]


def _up_to_date(out: Path, wanted: dict, verify: bool, say) -> ShardManifest | None:
    """The set in `out` when it was made from the same inputs and its files are whole."""
    if not (out / "manifest.json").is_file():
        return None
    try:
        m = ShardManifest.read(out)
    except BrigadeError:
        return None
    if {k: getattr(m, k) for k in wanted} != wanted:
        return None
    if verify:
        bad = failing_checksums(out, m)
        if bad:
            say(f"brigade tokenize: {', '.join(bad)} in {out} fails its checksum: tokenizing again")
            return None
    else:
        from brigade.data.shards import ShardSet

        try:
            ShardSet.open(out)
        except BrigadeError as exc:
            say(f"brigade tokenize: {exc}; tokenizing again")
            return None
    say(f"brigade tokenize: {out} is up to date ({m.tokens:,} tokens, {m.documents:,} documents)")
    return m


def _write(cfg: TokenizeConfig, sources, tokenizer, wanted: dict, directory: str, partial: Path,
           progress: bool) -> ShardManifest:
    from tqdm import tqdm

    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    writer = ShardWriter(partial, dtype_for(vocab), cfg.shard_tokens)
    eos, stream, chat = find_eos(tokenizer), _Stream(), Chat(directory)
    total = sum(s.path.stat().st_size for s in sources if s.kind != "builtin")
    with tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", disable=not progress) as bar:
        for batch in _batches(p for s in sources for p in read_pieces(s, cfg.field, bar.update, chat)):
            ids, mask, starts = _encode(tokenizer, batch, eos, stream)
            writer.add(ids, mask, starts)
    if writer.tokens == 0:
        raise BrigadeError(f"the corpus {' '.join(cfg.corpus) or '(built in)'} has no text: give "
                           "files with text in them")
    shards, documents = writer.close()
    manifest = ShardManifest(**wanted, tokenizer=directory, dtype=dtype_for(vocab), eos=eos,
                             max_id=stream.max_id, tokens=writer.tokens, documents=writer.documents,
                             shards=shards, documents_file=documents)
    manifest.write(partial)
    return manifest


def _batches(pieces: Iterator[Piece]) -> Iterator[list[Piece]]:
    batch, chars = [], 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece.text)
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _encode(tokenizer, batch: list[Piece], eos: int | None,
            stream: _Stream) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """One batch's ids, mask and document starts, packed after what came before."""
    encodings = tokenizer.encode_batch_fast([p.text for p in batch], add_special_tokens=False)
    ids, mask, starts, at = [], [], [], 0
    for piece, enc in zip(batch, encodings, strict=True):
        if piece.starts_document:
            if stream.started and eos is not None:
                ids.append(np.array([eos], dtype=np.int64))
                mask.append(np.array([stream.last_counted]))
                at += 1
            starts.append(at)
            stream.started = True
        piece_ids = np.asarray(enc.ids, dtype=np.int64)
        ids.append(piece_ids)
        mask.append(np.full(len(piece_ids), piece.loss))
        at += len(piece_ids)
        stream.last_counted = piece.loss
    out = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    if len(out):
        stream.max_id = max(stream.max_id, int(out.max()))
    return out, (np.concatenate(mask) if mask else np.zeros(0, bool)), starts


def _put_in_place(partial: Path, out: Path) -> None:
    """Rename the finished set to `out`, replacing an older one there."""
    from brigade.fsutil import fsync_path

    old = None
    if out.exists():
        old = out.parent / f".{out.name}.{os.getpid()}.old"
        os.rename(out, old)
    os.rename(partial, out)
    fsync_path(out.parent)
    if old is not None:
        remove_tree(old)
