"""Token shards on disk: the format `brigade tokenize` writes, and windows read from them through
memory maps, so a rank's memory does not grow with the corpus.

A shard set is a folder:

    manifest.json         what follows, each file's SHA-256; written last: no manifest, no set
    tokens-00000.bin      token ids, little-endian uint16 (a vocabulary of ≤ 65,536) or uint32
    tokens-00001.bin      ...   the files concatenated are one stream of the packed documents
    mask-00000.bin        instruction data only: one byte per token, 1 where it is a target the
                          loss counts (absent when every token is)
    documents.bin         uint64: where each document starts in the stream

The stream packs documents with the tokenizer's end-of-sequence token between them (as
`tokenize` describes). Example k of a part [lo, hi) of the stream is the window of
block_size + 1 ids from lo + k · block_size: the windows tile it, and a window may cross from
one file into the next. The validation part is the stream's last `val_fraction`, cut at a
fixed token position.

With `documents` (a run's default, `--no-document-mask` off) a batch also says where each of its
windows' documents start: (B, T) int64, each input token's document counted from 0 at the
window's first token (`models.documents`), read from documents.bin by binary search.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from brigade.errors import BrigadeError

FORMAT = "brigade-tokens/1"
MANIFEST = "manifest.json"
IGNORE = -100  # a target the loss skips (the Hugging Face families' ignore index)
_CHUNK = 1 << 22  # bytes hashed at a time


def dtype_for(vocab_size: int) -> str:
    """The narrowest unsigned type that holds every id of a vocabulary."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass
class ShardManifest:
    """manifest.json: the tokenizer, the counts, and every file with its checksum."""

    tokenizer_sha256: str
    tokenizer: str  # the model directory it came from, for people
    dtype: str
    eos: int | None
    max_id: int
    tokens: int
    documents: int
    shards: list[dict]  # {"name", "tokens", "sha256", and "mask": {"name", "sha256"} if masked}
    documents_file: dict  # {"name", "sha256"}
    sources: list[dict]  # each source's fingerprint (corpus.Source.fingerprint)
    options: dict  # what else the ids depend on: the text field
    format: str = FORMAT

    @property
    def masked(self) -> bool:
        return any("mask" in s for s in self.shards)

    def content_sha256(self) -> str:
        """The identity of the ids themselves (and masks): equal exactly when the same stream."""
        parts = [self.tokenizer_sha256] + [s["sha256"] + s.get("mask", {}).get("sha256", "")
                                           for s in self.shards]
        return hashlib.sha256("".join(parts).encode()).hexdigest()

    def files(self) -> list[dict]:
        """Every file of the set with its checksum: shards, masks, document starts."""
        return ([{"name": s["name"], "sha256": s["sha256"]} for s in self.shards]
                + [s["mask"] for s in self.shards if "mask" in s] + [self.documents_file])

    def write(self, folder: Path) -> None:
        from brigade.fsutil import write_atomic

        write_atomic(folder / MANIFEST, json.dumps(dataclasses.asdict(self), indent=1) + "\n")

    @classmethod
    def read(cls, folder: Path) -> ShardManifest:
        """Raises: BrigadeError: no manifest.json, or not one `brigade tokenize` wrote."""
        path = Path(folder) / MANIFEST
        if not path.is_file():
            raise BrigadeError(f"{str(folder)!r} has no {MANIFEST}: it is not a finished token shard "
                               "set; run brigade tokenize into it (again)")
        try:
            raw = json.loads(path.read_text())
            if raw.get("format") != FORMAT:
                raise ValueError(raw.get("format"))
            return cls(**raw)
        except (ValueError, TypeError):
            raise BrigadeError(f"{str(path)!r} is not a manifest brigade tokenize wrote ({FORMAT}): "
                               "run brigade tokenize into a new folder") from None


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def failing_checksums(folder: Path, manifest: ShardManifest) -> list[str]:
    """The names of the set's files that are missing or fail their checksum (reads every byte)."""
    return [f["name"] for f in manifest.files()
            if not (folder / f["name"]).is_file() or sha256_of(folder / f["name"]) != f["sha256"]]


class ShardSet:
    """A shard set opened for reading: the stream's ids (and masks) by position, memory-mapped."""

    def __init__(self, folder: Path, manifest: ShardManifest):
        self.folder, self.manifest = Path(folder), manifest
        self.dtype = np.dtype(manifest.dtype).newbyteorder("<")
        sizes = [s["tokens"] for s in manifest.shards]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._maps: dict[str, np.memmap] = {}

    @classmethod
    def open(cls, folder: str | Path, tokenizer_sha256: str | None = None) -> ShardSet:
        """Open a set, checking what is cheap to check: its tokenizer, each file's size.

        Raises:
            BrigadeError: not a shard set; tokenized by another tokenizer than the model's; a
                file missing or of the wrong size (truncated).
        """
        folder = Path(folder)
        m = ShardManifest.read(folder)
        if tokenizer_sha256 is not None and m.tokenizer_sha256 != tokenizer_sha256:
            raise BrigadeError(f"the shards in {str(folder)!r} were tokenized by another tokenizer "
                               f"({m.tokenizer}, sha256 {m.tokenizer_sha256[:12]}) than the model's "
                               f"({tokenizer_sha256[:12]}): run brigade tokenize with this model")
        itemsize = np.dtype(m.dtype).itemsize
        for s in m.shards:
            _check_size(folder, s["name"], s["tokens"] * itemsize)
            if "mask" in s:
                _check_size(folder, s["mask"]["name"], s["tokens"])
        _check_size(folder, m.documents_file["name"], m.documents * 8)
        return cls(folder, m)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _map(self, name: str, dtype) -> np.memmap:
        if name not in self._maps:
            self._maps[name] = np.memmap(self.folder / name, dtype=dtype, mode="r")
        return self._maps[name]

    def read(self, start: int, stop: int, mask: bool = False) -> np.ndarray:
        """ids[start:stop] of the stream (or its mask bytes), across file boundaries."""
        out, first = [], int(np.searchsorted(self.starts, start, side="right")) - 1
        for i in range(first, len(self.manifest.shards)):
            lo, hi = max(start, self.starts[i]), min(stop, self.starts[i + 1])
            if lo >= hi:
                break
            s = self.manifest.shards[i]
            data = self._map(s["mask"]["name"], np.uint8) if mask else self._map(s["name"], self.dtype)
            out.append(data[lo - self.starts[i]: hi - self.starts[i]])
        return np.concatenate(out) if len(out) != 1 else out[0]

    def documents_of(self, start: int, stop: int) -> np.ndarray:
        """The document of each position in [start, stop), counted from 0 at `start`."""
        starts = self._map(self.manifest.documents_file["name"], np.dtype("<u8"))
        at = np.searchsorted(starts, np.arange(start, stop, dtype=np.uint64), side="right")
        return (at - at[0]).astype(np.int64)


def _check_size(folder: Path, name: str, expected: int) -> None:
    path = folder / name
    if not path.is_file():
        raise BrigadeError(f"{str(path)!r} is missing from the shard set: run brigade tokenize again")
    size = path.stat().st_size
    if size != expected:
        raise BrigadeError(f"{str(path)!r} has {size} bytes where its manifest says {expected} "
                           "(truncated or damaged): run brigade tokenize again")


class TokenWindows:
    """Windows of block_size + 1 ids tiling the part [lo, hi) of a shard set's stream: inputs and
    next-token targets (targets the loss skips are IGNORE, for instruction data).

    Works wherever a `text.CharDataset` does (`len`, `batch(indices) -> (inputs, targets)`);
    reads only the windows asked for. With `documents`, `batch` gives (inputs, targets,
    documents): each input token's document in its window (module docstring).
    """

    def __init__(self, shards: ShardSet, lo: int, hi: int, block_size: int, what: str,
                 documents: bool = False):
        if hi - lo < block_size + 1:
            raise BrigadeError(f"the {what} has {hi - lo} tokens, fewer than one sequence of "
                               f"{block_size} + 1: use more text or a smaller --block-size")
        self.shards, self.lo, self.hi, self.block_size = shards, lo, hi, block_size
        self.documents = documents

    def __len__(self) -> int:
        return (self.hi - self.lo - 1 - self.block_size) // self.block_size + 1

    def window(self, k: int, mask: bool = False) -> np.ndarray:
        start = self.lo + int(k) * self.block_size
        return self.shards.read(start, start + self.block_size + 1, mask)

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ids = torch.from_numpy(np.stack([self.window(k) for k in indices.tolist()]).astype(np.int64))
        x, y = ids[:, :-1], ids[:, 1:].clone()
        if self.shards.manifest.masked:
            counted = np.stack([self.window(k, mask=True) for k in indices.tolist()])[:, 1:]
            y[torch.from_numpy(counted == 0)] = IGNORE
        if not self.documents:
            return x, y
        starts = [self.lo + int(k) * self.block_size for k in indices.tolist()]
        docs = np.stack([self.shards.documents_of(s, s + self.block_size) for s in starts])
        return x, y, torch.from_numpy(docs)


def split(shards: ShardSet, block_size: int, val_fraction: float,
          documents: bool = False) -> tuple[TokenWindows, TokenWindows]:
    """Training and validation windows: the stream cut at a fixed token position, the last
    `val_fraction` held out.

    `documents`: as `TokenWindows`'.

    Raises:
        BrigadeError: too few tokens for one sequence in either part.
    """
    total = len(shards)
    if total < block_size + 1:
        raise BrigadeError(f"the data has {total} tokens, fewer than one sequence of {block_size} + 1: "
                           "use more text or a smaller --block-size")
    cut = int(total * (1 - val_fraction))
    return (TokenWindows(shards, 0, cut, block_size, "training part of --data", documents),
            TokenWindows(shards, cut, total, block_size, "validation part of --data", documents))


def remove_tree(path: Path) -> None:
    """Remove a folder the writer made (flat: files only)."""
    if path.is_dir():
        for child in path.iterdir():
            child.unlink()
        os.rmdir(path)
