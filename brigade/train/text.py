"""Text as a run reads it: a UTF-8 file, checked, or the built-in corpus (`data` cuts it into
characters, `tokens` into a tokenizer's ids)."""

from __future__ import annotations

from pathlib import Path

from brigade.errors import BrigadeError


def default_corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def read_text(path: str) -> str:
    """Read a UTF-8 text file, or the default corpus for "".

    Raises:
        BrigadeError: missing, a directory, empty, or not text.
    """
    if not path:
        return default_corpus()
    p = Path(path)
    if p.is_dir():
        raise BrigadeError(f"--data {path!r} is a directory: give a text file")
    if not p.is_file():
        raise BrigadeError(f"--data {path!r} not found: give a UTF-8 text file, or omit it for the "
                           "built-in corpus")
    raw = p.read_bytes()
    if not raw.strip():
        raise BrigadeError(f"--data {path!r} is empty: give a file with text in it")
    if b"\x00" in raw[:65536]:
        raise BrigadeError(f"--data {path!r} looks binary (it has NUL bytes): give a UTF-8 text file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BrigadeError(f"--data {path!r} is not UTF-8 text (byte {exc.start}): convert it to UTF-8") \
            from None
