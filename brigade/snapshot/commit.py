"""Rank 0's last act of a snapshot: verify what every rank wrote, then mark it complete.

Called once DCP has finished (every rank's shards and the `.metadata` on disk), whether the
write was synchronous or ran in the background (`writer.py`). Nothing here is collective, so
it can run in a background thread while the ranks train on:

    checksum every file → read every parameter back and hash it (params_sha256) → manifest
    → fsync → rename .tmp-step_N to step_N → LATEST → remove snapshots beyond --keep

Reading the parameters back from the files, rather than hashing the live ones, makes the
manifest's `params_sha256` a statement about what is on disk (the same value: the hash of
each whole parameter in name order, whatever the layout), and proves the files read back.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from brigade.fsutil import fsync_path, write_atomic
from brigade.snapshot.format import (
    MANIFEST,
    Manifest,
    params_sha256,
    sha256_file,
    snapshot_dirs,
    tensor_sha256,
    write_pointer,
)

_READ_BACK_BYTES = 256 << 20  # parameters read back per DCP load: bounds rank 0's extra memory


class Abandoned(Exception):
    """The snapshot was abandoned (SIGTERM's grace ran out) before it was marked complete."""


def read_back_sha256(folder: Path, names: list[str], reader_type) -> str:
    """`params_sha256` of the parameters `names` as the snapshot in `folder` stores them.

    Args:
        names: every rank's parameter names (aliases of a tie left out), gathered once.
        reader_type: the storage reader class (`collective.SafeReader`): no pickle is trusted.
    """
    meta = reader_type(folder).read_metadata().state_dict_metadata
    hashes: dict[str, str] = {}
    batch: dict[str, torch.Tensor] = {}
    held = 0
    for name in sorted(names):
        info = meta[f"model.{name}"]
        batch[name] = torch.empty(info.size, dtype=info.properties.dtype)
        held += batch[name].numel() * batch[name].element_size()
        if held >= _READ_BACK_BYTES:
            hashes.update(_hash_batch(folder, batch, reader_type))
            batch, held = {}, 0
    hashes.update(_hash_batch(folder, batch, reader_type))
    return params_sha256(hashes)


def _hash_batch(folder: Path, batch: dict, reader_type) -> dict[str, str]:
    if not batch:
        return {}
    state = {"model": batch}
    dcp.load(state, storage_reader=reader_type(folder), no_dist=True)
    return {name: tensor_sha256(t) for name, t in state["model"].items()}


class Commit:
    """Rank 0's commit of one snapshot; `abandon()` may stop it before the point of no return.

    Args:
        tmp, final: the folder being written and its name once complete.
        meta: the manifest's run facts and step (`compat.run_facts`, plus "step", "world_size").
        names: every rank's parameter names, for `params_sha256`.
        keep: complete snapshots to keep.
    """

    def __init__(self, tmp: Path, final: Path, meta: dict, names: list[str], keep: int, reader_type):
        self.tmp, self.final, self.meta, self.names, self.keep = tmp, final, meta, names, keep
        self.reader_type = reader_type
        self._lock = threading.Lock()
        self._abandoned = False
        self.committed = False

    def abandon(self) -> bool:
        """Make sure this snapshot is never marked complete; False if it already is."""
        with self._lock:
            self._abandoned = not self.committed
            return self._abandoned

    def run(self) -> Path:
        """Checksums, read-back hash, manifest, rename, LATEST, pruning; the complete folder.

        Raises:
            OSError: a file cannot be read or written (one line from the caller).
            ValueError: the manifest would not read back (`Manifest.from_json`).
            Abandoned: `abandon()` came first.
        """
        tmp = self.tmp
        for f in tmp.iterdir():
            fsync_path(f)
        manifest = Manifest.from_json({
            **self.meta,
            "params_sha256": read_back_sha256(tmp, self.names, self.reader_type),
            "files": {f.name: sha256_file(f) for f in sorted(tmp.iterdir()) if f.is_file()},
        })  # checked as `verify` will read it: a snapshot that cannot be read is never committed
        write_atomic(tmp / MANIFEST, json.dumps(manifest.to_json(), indent=1))
        fsync_path(tmp)
        with self._lock:
            if self._abandoned:
                raise Abandoned(self.final.name)
            self._rename()
            self.committed = True
        for old in snapshot_dirs(self.final.parent.parent)[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)
        return self.final

    def _rename(self) -> None:
        """The point of no return: the folder takes its final name, then LATEST names it."""
        final, snaps = self.final, self.final.parent
        if final.exists():  # the same step again (a resumed run): replace it whole
            shutil.rmtree(final)
        os.replace(self.tmp, final)
        fsync_path(snaps)
        write_pointer(snaps, final.name)
