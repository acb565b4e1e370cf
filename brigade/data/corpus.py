"""A corpus read a piece at a time: the documents of text files, folders, JSON Lines, Parquet and
`datasets` folders, never the whole of it in memory.

Formats (by what the path is, then by its name):

| path | documents |
|---|---|
| a text file (any other name) | the whole file, one document (read in ~256 KiB pieces cut after a newline) |
| `*.jsonl`, `*.json` | JSON Lines: one document per non-empty line (an object) |
| `*.parquet` | one document per row |
| a folder written by `datasets`' `save_to_disk` (`state.json` and `*.arrow`) | one document per row |
| any other folder | every file under it, in sorted path order, each as above (hidden files left out) |

A row (a JSON object, a Parquet or Arrow row) is a document by its fields (`instruct.row_pieces`):
a string `text` (or `--field`), or `messages` (a chat, by the tokenizer's template), or `prompt`
and `completion`; the loss counts the completion (the assistant's turns) only.

Each source's identity (path, size, modification time) is its `fingerprint`: the same
fingerprints, tokenizer and options make `brigade tokenize` again a no-op.
"""

from __future__ import annotations

import codecs
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from brigade.data.instruct import Chat, row_pieces
from brigade.data.piece import Piece
from brigade.data.text import default_corpus
from brigade.errors import BrigadeError

JSON_LINES_SUFFIXES = (".jsonl", ".json")
PIECE_CHARS = 1 << 18  # a text file is tokenized in pieces of about this many bytes
_SNIFF = 65536  # bytes looked at for NUL bytes: a binary file has them early


@dataclass(frozen=True)
class Source:
    """One file of a corpus and how it is read: "text", "jsonl", "parquet" or "arrow"; or
    "builtin", CPython's documentation topics (`text.default_corpus`)."""

    path: Path
    kind: str

    def fingerprint(self) -> dict:
        if self.kind == "builtin":
            return {"path": "", "kind": "builtin", "python": sys.version}
        stat = self.path.stat()
        return {"path": str(self.path.resolve()), "kind": self.kind, "bytes": stat.st_size,
                "mtime_ns": stat.st_mtime_ns}


def find_sources(paths: list[str]) -> list[Source]:
    """The files a corpus is made of, in the order they are read; [""]: the built-in corpus.

    Raises:
        BrigadeError: a path that does not exist, or a folder with no files.
    """
    found: list[Source] = []
    for given in paths:
        if not given:
            found.append(Source(Path("pydoc_data.topics"), "builtin"))
            continue
        path = Path(given)
        if not path.exists():
            raise BrigadeError(f"corpus {given!r} not found: give text files, JSON Lines, Parquet "
                               "files or folders of them")
        if path.is_dir():
            found += _folder(path)
        else:
            found.append(Source(path, _kind(path)))
    return found


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSON_LINES_SUFFIXES):
        return "jsonl"
    return "parquet" if name.endswith(".parquet") else "text"


def _folder(path: Path) -> list[Source]:
    state = path / "state.json"
    if state.is_file():  # written by datasets' save_to_disk: its Arrow files, in its order
        try:
            files = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError):
            raise BrigadeError(f"{str(state)!r} is not the state.json that datasets' save_to_disk "
                               "writes: save the dataset again") from None
        return [Source(path / f, "arrow") for f in files]
    files = sorted(p for p in path.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise BrigadeError(f"corpus folder {str(path)!r} has no files: put text, JSON Lines or "
                           "Parquet files in it")
    return [Source(p, _kind(p)) for p in files]


def read_pieces(source: Source, field: str, tick: Callable[[int], None],
                chat: Chat | None = None) -> Iterator[Piece]:
    """The pieces of one source, in order; `tick(n)` is told of every n bytes read.

    Args:
        source: the file and its kind.
        field: the string field of a row that holds its text.
        tick: progress, in bytes of the source.
        chat: renders a `messages` row (the model directory's template); None: such a row is
            refused.

    Raises:
        BrigadeError: a binary or non-UTF-8 text file; a JSON line that is not an object; a row
            without text; an unreadable Parquet or Arrow file.
    """
    if source.kind == "builtin":
        yield Piece(default_corpus())
        return
    if source.kind == "text":
        yield from _text_pieces(source.path, tick)
        return
    rows = _json_rows(source.path, tick) if source.kind == "jsonl" else _table_rows(source, field, tick)
    for where, row in rows:
        yield from row_pieces(row, field, where, chat)


def _text_pieces(path: Path, tick: Callable[[int], None]) -> Iterator[Piece]:
    """A text file as one document, in pieces of about PIECE_CHARS bytes cut after a newline (or
    anywhere, in a file whose lines are longer than four pieces); an empty file is none."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    started, carry, offset = False, b"", 0
    with open(path, "rb") as f:
        if b"\x00" in f.read(_SNIFF):
            raise BrigadeError(f"{str(path)!r} looks binary (it has NUL bytes): give UTF-8 text files")
        f.seek(0)
        while True:
            block = f.read(PIECE_CHARS)
            carry += block
            cut = len(carry) if not block else (
                carry.rfind(b"\n") + 1 or (len(carry) if len(carry) >= 4 * PIECE_CHARS else 0))
            if cut:
                text = _decoded(carry[:cut], decoder, path, offset, final=not block)
                if not started:
                    text = text.removeprefix("\ufeff")
                if started or text.strip():
                    yield Piece(text, starts_document=not started)
                    started = True
                offset, carry = offset + cut, carry[cut:]
                tick(cut)
            if not block:
                return


def _decoded(raw: bytes, decoder, path: Path, offset: int, final: bool) -> str:
    try:
        return decoder.decode(raw, final=final)
    except UnicodeDecodeError as exc:
        raise BrigadeError(f"{str(path)!r} is not UTF-8 text (byte {offset + exc.start}): "
                           "convert it to UTF-8") from None


def _json_rows(path: Path, tick: Callable[[int], None]) -> Iterator[tuple[str, dict]]:
    """(where, object) for each non-empty line of a JSON Lines file; split on "\\n" only
    (str.splitlines would also cut at U+2028, which JSON allows in a string)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            tick(len(raw))
            where = f"{str(path)!r} line {number}"
            try:
                line = raw.decode("utf-8").removeprefix("\ufeff")
            except UnicodeDecodeError:
                raise BrigadeError(f"{where} is not UTF-8 text: convert the file to UTF-8") from None
            if line.strip():
                yield where, _object(line, where)


def _object(line: str, where: str) -> dict:
    example = 'each line must be an object like {"text": "..."}'
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BrigadeError(f"{where} is not valid JSON ({exc.msg}, column {exc.colno}): {example}") \
            from None
    if not isinstance(obj, dict):
        raise BrigadeError(f"{where} is a JSON {type(obj).__name__}, not an object: {example}")
    return obj


def _table_rows(source: Source, field: str, tick: Callable[[int], None]) -> Iterator[tuple[str, dict]]:
    """(where, row) for each row of a Parquet file or of a `datasets` Arrow file, a batch of rows
    in memory at a time."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise BrigadeError(f"{str(source.path)!r} needs the 'pyarrow' package: pip install -e '.[data]'") \
            from None
    size = source.path.stat().st_size
    try:
        if source.kind == "parquet":
            table = pq.ParquetFile(source.path)
            total = table.metadata.num_rows
            batches = table.iter_batches(batch_size=1024, columns=_columns(table.schema_arrow.names,
                                                                           field, source))
        else:
            reader = pa.ipc.open_stream(pa.memory_map(str(source.path)))
            total, batches = None, reader
        row = 0
        for batch in batches:
            for values in batch.to_pylist():
                row += 1
                yield f"{str(source.path)!r} row {row}", values
            tick(int(size * batch.num_rows / total) if total else 0)
    except (pa.ArrowException, OSError) as exc:
        raise BrigadeError(f"{str(source.path)!r} is not a {source.kind} file pyarrow can read "
                           f"({str(exc).splitlines()[0]}): write it again") from None
    if not total:
        tick(size)


def _columns(names: list[str], field: str, source: Source) -> list[str]:
    wanted = [c for c in (field, "messages", "prompt", "completion") if c in names]
    if not wanted:
        raise BrigadeError(f"{str(source.path)!r} has no column {field!r} (its columns: "
                           f"{', '.join(names)}): give --field with the column that holds the text")
    return wanted
