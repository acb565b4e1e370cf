"""The snapshot format on disk: folders, the typed manifest, the LATEST pointer, verification.

    OUT/snapshots/
      step_00000200/           a complete snapshot
        .metadata, *.distcp    DCP: every rank writes its own blocks, named layout-free
        rng_<rank>.json        each rank's random-number generator states
        manifest.json          step, layout, sha256 of every file, params_sha256 (written last)
      .tmp-step_00000300/      being written: never read, removed by the next save
      LATEST                   "step_00000200", replaced only after the rename

Write: DCP into a temporary folder → fsync → checksums, parameters read back and hashed,
manifest → rename → LATEST. A kill at any moment leaves the previous snapshot and pointer
intact; so does a failure, and so does a snapshot abandoned at a stop signal.
Read: newest first, checksums verified; a corrupt or incomplete one is skipped
with a warning. Writing across ranks is `writer.py` (at once or in the background; its last
act, rank 0's, is `commit.py`), loading `collective.py`; whether a snapshot fits a
configuration is `compat.py`; the RNG states are `rng.py`.
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from brigade.errors import BrigadeError
from brigade.fsutil import write_atomic

POINTER = "LATEST"
MANIFEST = "manifest.json"


class SnapshotError(BrigadeError):
    """A snapshot that cannot be used: corrupt, incomplete, or from another run."""


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


@dataclass(frozen=True)
class Manifest:
    """What `manifest.json` holds: the one list of its keys and their types.

    Written by `commit.Commit` (rank 0, last), read here by `verify`; readers use these
    attributes. Keys this version does not know are kept in `extra` (a newer writer's additions).
    Optional keys (`loss_scale`, `balance`, `data`, `lr_end`) may be absent: snapshots written
    before them still read.
    """

    step: int
    cursor: int
    epoch: int
    layout: dict  # {"dp", "pp", "local_stages", "virtual", "tp", "cp": int} (older: fewer)
    config_hash: str
    config: dict  # {"model": {...}, "optim": {...}, ...}: what must match to resume
    model: str
    vocab: str | None  # a GPT's characters; None for other models
    params_sha256: str
    world_size: int
    files: dict  # file name -> sha256 of every data file in the snapshot
    loss_scale: dict | None = None  # fp16: {"scale", "good_steps"} of the LossScaler; else absent
    balance: list | None = None  # blocks per stage the run was cut into; absent in older snapshots
    data: str | None = None  # a token shard set's content_sha256: the ids it trained on; else absent
    lr_end: int | None = None  # the step the learning rate's decay ends on (`config.lr`); else absent
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """The JSON object `from_json` reads back (optional keys only when set)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)
             if f.name != "extra" and not (f.name in _OPTIONAL and getattr(self, f.name) is None)}
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
                if name in _OPTIONAL:
                    continue
                raise ValueError(f"has no {name!r} key")
            if not _KEY_TYPES[name](data[name]):
                raise ValueError(f"has {name!r} = {_short(data[name])}, expected {_KEY_DOCS[name]}")
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**{k: data[k] for k in known if k in data}, extra=extra)


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_digest(v: object) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def _is_file_list(v: object) -> bool:
    """A non-empty {plain file name: sha256}: no folders, so no name can point outside."""
    return (isinstance(v, dict) and len(v) > 0
            and all(isinstance(k, str) and k not in ("", ".", "..", MANIFEST) and "/" not in k
                    and "\\" not in k and _is_digest(d) for k, d in v.items()))


def _is_loss_scale(v: object) -> bool:
    return (v is None or isinstance(v, dict) and set(v) == {"scale", "good_steps"}
            and isinstance(v["scale"], (int, float)) and not isinstance(v["scale"], bool)
            and v["scale"] > 0 and _is_count(v["good_steps"]))


_OPTIONAL = ("loss_scale", "balance", "data", "lr_end")
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
    "loss_scale": _is_loss_scale,
    "balance": lambda v: v is None or isinstance(v, list) and len(v) > 0 and all(
        _is_count(x) and x >= 1 for x in v),
    "data": lambda v: v is None or _is_digest(v),
    "lr_end": lambda v: v is None or _is_count(v) and v >= 1,
}
_KEY_DOCS = {
    "step": "an integer ≥ 0", "cursor": "an integer ≥ 0", "epoch": "an integer ≥ 0",
    "layout": "an object of integers", "config_hash": "a string",
    "config": "an object of objects", "model": "a model name", "vocab": "a string or null",
    "params_sha256": "a sha256 hex digest", "world_size": "an integer ≥ 1",
    "files": "a non-empty object of file name → sha256 hex digest",
    "loss_scale": "null or an object of scale > 0 and good_steps ≥ 0",
    "balance": "null or a non-empty list of integers ≥ 1",
    "data": "null or a sha256 hex digest",
    "lr_end": "null or an integer ≥ 1",
}


def _short(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class Snapshot:
    """A verified snapshot: its folder and its manifest."""

    path: Path
    manifest: Manifest


def folder_name(step: int) -> str:
    """The folder of step `step`'s snapshot inside OUT/snapshots: names sort by step."""
    return f"step_{step:08d}"


def read_pointer(snaps: Path) -> str | None:
    """The folder name LATEST points to in `snaps` (OUT/snapshots), or None without one."""
    pointer = snaps / POINTER
    if not pointer.is_file():
        return None
    return pointer.read_text().strip() or None


def write_pointer(snaps: Path, name: str) -> None:
    """Point LATEST at the snapshot folder `name`, atomically (after that folder is in place)."""
    write_atomic(snaps / POINTER, name)


def latest_step(out: str | Path) -> int | None:
    """The step of the snapshot LATEST points to under the run folder `out` (not verified:
    for messages while a run goes on); None if there is none."""
    name = read_pointer(Path(out) / "snapshots")
    if name is None or not name.startswith("step_") or not name[5:].isdigit():
        return None
    return int(name[5:])


def snapshot_dirs(root: Path) -> list[Path]:
    """Complete-looking snapshots, newest first (LATEST's choice leads)."""
    snaps = root / "snapshots"
    if not snaps.is_dir():
        return []
    dirs = sorted((d for d in snaps.iterdir() if d.is_dir() and d.name.startswith("step_")),
                  key=lambda d: d.name, reverse=True)
    pointed = read_pointer(snaps)
    if pointed is not None and snaps / pointed in dirs:
        dirs.remove(snaps / pointed)
        dirs.insert(0, snaps / pointed)
    return dirs


def read_manifest(path: Path) -> Manifest:
    """The typed manifest of the snapshot folder `path`, checksums not checked (see `verify`).

    Raises:
        SnapshotError: missing or malformed manifest.
    """
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise SnapshotError(f"{path} has no {MANIFEST}: the snapshot is incomplete")
    try:
        return Manifest.from_json(json.loads(manifest_path.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise SnapshotError(f"{manifest_path} is not JSON: the snapshot is damaged") from None
    except ValueError as exc:  # from_json: names the key
        raise SnapshotError(f"{manifest_path} {exc}: the snapshot is damaged") from None


def verify(path: Path) -> Manifest:
    """The manifest of a complete snapshot: well-formed, every file listed and matching its checksum.

    Raises:
        SnapshotError: missing or malformed manifest, missing or unlisted data file, checksum mismatch.
    """
    manifest = read_manifest(path)
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


def find_latest(out: str | Path, warn=warnings.warn) -> Snapshot | None:
    """The newest verified snapshot under the run folder `out`, falling back past damaged ones.

    Args:
        warn: called with one line per snapshot skipped.
    """
    root = Path(out)
    for path in snapshot_dirs(root):
        try:
            return Snapshot(path, verify(path))
        except SnapshotError as exc:
            warn(f"skipping snapshot {path.name}: {exc}")
    return None


def resolve(path: str | Path) -> Snapshot:
    """A run folder (its newest good snapshot) or a snapshot folder, verified.

    Raises:
        SnapshotError / BrigadeError: nothing usable at `path`.
    """
    p = Path(path)
    if not p.exists():
        raise BrigadeError(f"{str(p)!r} not found: give a run folder (--out of a run) or a snapshot folder")
    if (p / MANIFEST).exists() or p.name.startswith("step_"):
        return Snapshot(p, verify(p))
    found = find_latest(p, warn=lambda msg: print(f"brigade: warning: {msg}", file=sys.stderr, flush=True))
    if found is None:
        raise BrigadeError(f"{p} holds no complete snapshot: train with --out {p} first")
    return found
