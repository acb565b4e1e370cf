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
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
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


def rng_state(devices: Sequence[torch.device] = ()) -> dict:
    """This process's random-number generator states, as JSON-able lists.

    Args:
        devices: the GPUs this process computes on (where its model lives), in stage order. Only
            their generators are saved, not every visible GPU's: a rank owns its devices only,
            and a node with fewer GPUs can resume.
    Returns:
        {"torch", "python", optional "cuda" (one state per device, in order), optional "numpy"}.
    """
    state = {"torch": torch.get_rng_state().tolist(), "python": _py_state(random.getstate())}
    gpus = [d for d in devices if d.type == "cuda"]
    if gpus:
        state["cuda"] = [torch.cuda.get_rng_state(d).tolist() for d in gpus]
    if "numpy" in sys.modules:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [kind, keys.tolist(), pos, has_gauss, gauss]
    return state


def _py_state(s):
    return [s[0], list(s[1]), s[2]]


def set_rng_state(state: dict, devices: Sequence[torch.device] = ()) -> None:
    """Restore what `rng_state` saved; the k-th saved GPU state goes to the k-th of `devices`.

    Matching by position, not by index, lets a rank resume on other GPU numbers; states or
    devices without a partner (another layout) are left as they are.
    """
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    gpus = [d for d in devices if d.type == "cuda"]
    for saved, device in zip(state.get("cuda", []), gpus):
        torch.cuda.set_rng_state(torch.tensor(saved, dtype=torch.uint8), device)
    if "numpy" in state and "numpy" in sys.modules:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


@dataclass(frozen=True)
class Manifest:
    """What `manifest.json` holds: the one list of its keys and their types.

    Written by `checkpoint.save` (rank 0, last), read here by `verify`; readers use these
    attributes. Keys this version does not know are kept in `extra` (a newer writer's additions).
    """

    step: int
    cursor: int
    epoch: int
    layout: dict  # {"dp": int, "pp": int, "local_stages": int}
    config_hash: str
    config: dict  # {"model": {...}, "optim": {...}, ...}: what must match to resume
    model: str
    vocab: str | None  # a GPT's characters; None for other models
    params_sha256: str
    world_size: int
    files: dict  # file name -> sha256 of every data file in the snapshot
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """The JSON object `from_json` reads back."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {**self.extra, **d}

    @classmethod
    def from_json(cls, data: object) -> Manifest:
        """Parse and type-check a manifest's JSON value.

        Raises:
            ValueError: one line naming the key that is missing or of the wrong type.
        """
        if not isinstance(data, dict):
            raise ValueError(f"is a JSON {type(data).__name__}, not an object")
        known = {f.name: f for f in fields(cls) if f.name != "extra"}
        for name in known:
            if name not in data:
                raise ValueError(f"has no {name!r} key")
            if not _KEY_TYPES[name](data[name]):
                raise ValueError(f"has {name!r} = {_short(data[name])}, expected {_KEY_DOCS[name]}")
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**{k: data[k] for k in known}, extra=extra)


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_digest(v: object) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def _is_file_list(v: object) -> bool:
    """A non-empty {plain file name: sha256}: no folders, so no name can point outside."""
    return (isinstance(v, dict) and len(v) > 0
            and all(isinstance(k, str) and k not in ("", ".", "..", MANIFEST) and "/" not in k
                    and "\\" not in k and _is_digest(d) for k, d in v.items()))


_KEY_TYPES = {
    "step": _is_count, "cursor": _is_count, "epoch": _is_count,
    "layout": lambda v: isinstance(v, dict) and all(_is_count(x) for x in v.values()),
    "config_hash": lambda v: isinstance(v, str),
    "config": lambda v: isinstance(v, dict) and all(isinstance(x, dict) for x in v.values()),
    "model": lambda v: isinstance(v, str) and v != "",
    "vocab": lambda v: v is None or isinstance(v, str),
    "params_sha256": _is_digest,
    "world_size": lambda v: _is_count(v) and v >= 1,
    "files": _is_file_list,
}
_KEY_DOCS = {
    "step": "an integer ≥ 0", "cursor": "an integer ≥ 0", "epoch": "an integer ≥ 0",
    "layout": "an object of integers", "config_hash": "a string",
    "config": "an object of objects", "model": "a model name", "vocab": "a string or null",
    "params_sha256": "a sha256 hex digest", "world_size": "an integer ≥ 1",
    "files": "a non-empty object of file name → sha256 hex digest",
}


def _short(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class Found:
    path: Path
    meta: Manifest

    @property
    def manifest(self) -> dict:
        """The manifest as its JSON object (for readers not yet on `meta`'s attributes)."""
        return self.meta.to_json()


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


def verify(path: Path) -> Manifest:
    """The manifest of a complete snapshot: well-formed, every file listed and matching its checksum.

    Raises:
        SnapshotError: missing or malformed manifest, missing or unlisted data file, checksum mismatch.
    """
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise SnapshotError(f"{path} has no {MANIFEST}: the snapshot is incomplete")
    try:
        manifest = Manifest.from_json(json.loads(manifest_path.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise SnapshotError(f"{manifest_path} is not JSON: the snapshot is damaged") from None
    except ValueError as exc:  # from_json: names the key
        raise SnapshotError(f"{manifest_path} {exc}: the snapshot is damaged") from None
    present = {f.name for f in path.iterdir()} - {MANIFEST}
    unlisted = sorted(present - set(manifest.files))
    if unlisted:
        raise SnapshotError(f"{path}: {unlisted[0]} is not in its {MANIFEST} "
                            "(a file added or a manifest altered): the snapshot is damaged")
    for name, digest in manifest.files.items():
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
