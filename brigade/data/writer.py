"""Writing a shard set: ids appended a batch at a time into files of at most `shard_tokens`,
each file hashed as it is written, into a folder that becomes the set only when its manifest is
in it (`tokenize` renames it into place)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np


class _File:
    """One output file and the SHA-256 of what went into it."""

    def __init__(self, path: Path):
        self.path, self.sha, self.f = path, hashlib.sha256(), open(path, "wb")

    def write(self, array: np.ndarray) -> None:
        data = array.tobytes()
        self.sha.update(data)
        self.f.write(data)

    def close(self) -> dict:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return {"name": self.path.name, "sha256": self.sha.hexdigest()}


class ShardWriter:
    """Appends ids, their loss mask and document starts; `close` returns the manifest's parts.

    Masks are written for every token and dropped at the end when every one was counted (the
    usual, non-instruction corpus), so the writer need not know in advance.
    """

    def __init__(self, folder: Path, dtype: str, shard_tokens: int):
        self.folder, self.dtype, self.shard_tokens = folder, np.dtype(dtype).newbyteorder("<"), shard_tokens
        self.shards: list[dict] = []
        self.tokens = self.documents = 0
        self.all_counted = True
        self._ids = self._mask = None
        self._in_file = 0
        self._docs = _File(folder / "documents.bin")

    def _open(self) -> None:
        self._close_current()
        n = len(self.shards)
        self._ids = _File(self.folder / f"tokens-{n:05d}.bin")
        self._mask = _File(self.folder / f"mask-{n:05d}.bin")
        self._in_file = 0

    def _close_current(self) -> None:
        if self._ids is not None:
            shard = {**self._ids.close(), "tokens": self._in_file, "mask": self._mask.close()}
            self.shards.append(shard)
            self._ids = self._mask = None

    def add(self, ids: np.ndarray, mask: np.ndarray, document_starts: list[int]) -> None:
        """Append ids (with mask: 1 counted, 0 not) and the starts of documents in them
        (positions in this batch)."""
        self._docs.write(np.asarray(document_starts, dtype="<u8") + self.tokens)
        self.documents += len(document_starts)
        self.all_counted = self.all_counted and bool(mask.all())
        done = 0
        while done < len(ids):
            if self._ids is None or self._in_file == self.shard_tokens:
                self._open()
            take = min(len(ids) - done, self.shard_tokens - self._in_file)
            self._ids.write(ids[done: done + take].astype(self.dtype))
            self._mask.write(mask[done: done + take].astype(np.uint8))
            self._in_file += take
            done += take
        self.tokens += len(ids)

    def close(self) -> tuple[list[dict], dict]:
        """(shards, documents file) for the manifest; the mask files removed when unneeded."""
        self._close_current()
        documents = self._docs.close()
        if self.all_counted:
            for s in self.shards:
                (self.folder / s.pop("mask")["name"]).unlink()
        return self.shards, documents
