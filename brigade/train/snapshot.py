"""Complete, atomic, verified snapshots with torch.distributed.checkpoint.

    OUT/snapshots/
      step_00000200/           a complete snapshot
        .metadata, *.distcp    DCP: every rank writes its own blocks, named layout-free
        rng_<rank>.json        each rank's random-number generator states
        manifest.json          step, layout, sha256 of every file, params_sha256 (written last)
      .tmp-step_00000300/      being written: never read, removed by the next save
      LATEST                   "step_00000200", replaced only after the rename

Write: DCP into a temporary folder → fsync → checksums and manifest → rename →
LATEST. A kill at any moment leaves the previous snapshot and pointer intact.
Read: newest first, checksums verified; a corrupt or incomplete one is skipped
with a warning. No pickle from disk is trusted: DCP's metadata goes through an
unpickler that only admits DCP's own metadata classes, and tensors load with
`weights_only=True`.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from brigade.errors import BrigadeError

POINTER = "LATEST"
MANIFEST = "manifest.json"


class SnapshotError(BrigadeError):
    """A snapshot that cannot be used: corrupt, incomplete, or from another run."""


class _MetadataUnpickler(pickle.Unpickler):
    """Admit only the classes DCP puts in its `.metadata` file."""

    def find_class(self, module: str, name: str):
        allowed = (
            module.startswith("torch.distributed.checkpoint.")
            or (module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None),
                                                                   (torch.dtype, torch.layout,
                                                                    torch.memory_format))))
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath"))
            or (module == "collections" and name == "OrderedDict")
        )
        if not allowed:
            raise SnapshotError(f"snapshot metadata refers to {module}.{name}, which a snapshot never "
                                "contains: the file is not a brigade snapshot; refusing to load it")
        return super().find_class(module, name)


class SafeReader(dcp.FileSystemReader):
    def read_metadata(self):
        path = Path(self.path) / ".metadata"
        with open(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except SnapshotError:
                raise
            except Exception as exc:
                raise SnapshotError(f"{path} is unreadable ({type(exc).__name__}): the snapshot is damaged")\
                    from None
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tensor_sha256(t: torch.Tensor) -> str:
    data = t.detach().to("cpu").contiguous()
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()


def params_sha256(named: dict[str, str]) -> str:
    """One hash over every parameter's hash in name order: equal whatever the layout."""
    h = hashlib.sha256()
    for name in sorted(named):
        h.update(f"{name}:{named[name]}\n".encode())
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state().tolist(), "python": _py_state(random.getstate())}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    if "numpy" in sys.modules:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), pos, has_gauss, gauss]
    return state


def _py_state(s):
    return [s[0], list(s[1]), s[2]]


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
    if "numpy" in state and "numpy" in sys.modules:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


@dataclass
class Found:
    path: Path
    manifest: dict


def snapshot_dirs(root: Path) -> list[Path]:
    """Complete-looking snapshots, newest first (LATEST's choice leads)."""
    snaps = root / "snapshots"
    if not snaps.is_dir():
        return []
    dirs = sorted((d for d in snaps.iterdir() if d.is_dir() and d.name.startswith("step_")),
                  key=lambda d: d.name, reverse=True)
    pointer = snaps / POINTER
    if pointer.is_file():
        first = snaps / pointer.read_text().strip()
        if first in dirs:
            dirs.remove(first)
            dirs.insert(0, first)
    return dirs


def verify(path: Path) -> dict:
    """The manifest of a complete snapshot whose files all match their checksums.

    Raises:
        SnapshotError: missing manifest, missing or extra data file, checksum mismatch.
    """
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise SnapshotError(f"{path} has no {MANIFEST}: the snapshot is incomplete")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
    except (ValueError, KeyError, UnicodeDecodeError):
        raise SnapshotError(f"{manifest_path} is not a brigade manifest: the snapshot is damaged") from None
    for name, digest in files.items():
        f = path / name
        if not f.is_file():
            raise SnapshotError(f"{path}: {name} is missing")
        if sha256_file(f) != digest:
            raise SnapshotError(f"{path}: {name} does not match its checksum (damaged or truncated)")
    return manifest


def find_latest(out: str | Path, warn=warnings.warn) -> Found | None:
    """The newest verified snapshot under `out`, falling back past damaged ones."""
    root = Path(out)
    for path in snapshot_dirs(root):
        try:
            return Found(path, verify(path))
        except SnapshotError as exc:
            warn(f"skipping snapshot {path.name}: {exc}")
    return None


def resolve(path: str | Path) -> Found:
    """A run folder (its newest good snapshot) or a snapshot folder, verified.

    Raises:
        SnapshotError / BrigadeError: nothing usable at `path`.
    """
    p = Path(path)
    if not p.exists():
        raise BrigadeError(f"{str(p)!r} not found: give a run folder (--out of a run) or a snapshot folder")
    if (p / MANIFEST).exists() or p.name.startswith("step_"):
        return Found(p, verify(p))
    found = find_latest(p, warn=lambda msg: print(f"warning: {msg}", file=sys.stderr))
    if found is None:
        raise BrigadeError(f"{p} holds no complete snapshot: train with --out {p} first")
    return found
