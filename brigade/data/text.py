"""Text as a run reads it: a UTF-8 file, checked, or the built-in corpus, and the windows of ids
cut from it (`data` makes its ids characters, `tokens` a tokenizer's)."""

from __future__ import annotations

from pathlib import Path

import torch

from brigade.errors import BrigadeError


def default_corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def read_text(path: str, flag: str = "--data") -> str:
    """Read a UTF-8 text file, or the default corpus for "" (`flag`: the option that named it, for
    the error's line).

    Raises:
        BrigadeError: missing, a directory, empty, or not text.
    """
    if not path:
        return default_corpus()
    p = Path(path)
    if p.is_dir():
        raise BrigadeError(f"{flag} {path!r} is a directory: give a text file")
    if not p.is_file():
        raise BrigadeError(f"{flag} {path!r} not found: give a UTF-8 text file"
                           + (", or omit it for the built-in corpus" if flag == "--data" else ""))
    raw = p.read_bytes()
    if not raw.strip():
        raise BrigadeError(f"{flag} {path!r} is empty: give a file with text in it")
    if b"\x00" in raw[:65536]:
        raise BrigadeError(f"{flag} {path!r} looks binary (it has NUL bytes): give a UTF-8 text file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BrigadeError(f"{flag} {path!r} is not UTF-8 text (byte {exc.start}): convert it to UTF-8") \
            from None


class CharDataset:
    """Windows of `block_size` + 1 characters: input and next-character targets.

    Example k starts at `stride` · k: every position here; `tokens.TokenDataset` tiles the
    text instead (stride = block_size)."""

    unit, piece, stride = "characters", "block", 1

    def __init__(self, ids: torch.Tensor, block_size: int, what: str = "corpus"):
        if len(ids) < block_size + 1:
            raise BrigadeError(
                f"the {what} has {len(ids)} {self.unit}, fewer than one {self.piece} of {block_size} + 1: "
                "use more text or a smaller --block-size"
            )
        self.ids = ids
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.ids) - 1 - self.block_size) // self._stride() + 1

    def _stride(self) -> int:
        return self.block_size if self.stride is None else self.stride

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = torch.arange(self.block_size + 1)
        windows = self.ids[indices[:, None] * self._stride() + offsets]  # (B, T + 1)
        return windows[:, :-1], windows[:, 1:]
