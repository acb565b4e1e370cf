"""Writing a run's snapshots across all ranks: at once, or in the background while training goes on.

`Writer.save(step, ...)` is collective. Synchronous, it returns once the snapshot is complete.
In the background (`background=True`, `--snapshot-async`):

1. every rank, at the call: its state dict is copied to CPU memory (DCP's staging), its RNG
   states are written, and the ranks agree that all of this worked. This is the whole stall.
2. a thread of DCP's writes the copy to disk, talking to the other ranks over a gloo group of
   the writer's own: the training collectives never share a group with it (sharing one aborted
   or hung on gloo, ../notes in docs/faults.md).
3. on rank 0, once DCP is done (it gathers every rank's result before it finishes, so every
   rank's files are on disk), `commit.Commit` verifies and marks the snapshot complete.

At most one snapshot is in flight: `save` first waits for the last one. Until rank 0's commit
renames the folder and moves LATEST, a kill at any moment leaves the newest complete snapshot
the one a restart resumes from; `Writing.abandon` (SIGTERM's grace ran out) makes sure a late
one is never marked complete.
"""

from __future__ import annotations

import datetime
import json
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from brigade import forensics
from brigade.fsutil import write_atomic
from brigade.snapshot.collective import (
    SafeReader,
    collective_device,
    devices_of,
    first_line,
    state_dicts,
    stored_params,
)
from brigade.snapshot.commit import Abandoned, Commit
from brigade.snapshot.format import SnapshotError, folder_name, read_pointer
from brigade.snapshot.rng import rng_state
from brigade.snapshot.ties import aliases_of, stored


class _Files(dcp.FileSystemWriter):
    """DCP's file writer, with a hook called on each rank as it starts writing its shards."""

    def __init__(self, path: Path, during_write=None):
        super().__init__(path)
        self.during_write = during_write

    def write_data(self, plan, planner):
        if self.during_write is not None:
            self.during_write()
        return super().write_data(plan, planner)


class Writing:
    """One snapshot on its way to disk. On rank 0 it ends with the commit; elsewhere with DCP.

    `error` is None or the one line that says why it failed; `abandoned` says it was stopped
    before it was marked complete; `seconds` is its time from the call to the end.
    """

    def __init__(self, step: int, started: float, commit: Commit | None):
        self.step, self.started, self.commit = step, started, commit
        self.error: str | None = None
        self.abandoned = False
        self.path: Path | None = None
        self.seconds = 0.0
        self._done = threading.Event()

    def finish(self, future=None) -> None:
        """Wait for DCP (`future`: the background write), then commit on rank 0; never raises."""
        try:
            if future is not None:
                future.result()
            if self.commit is not None:
                self.path = self.commit.run()
        except Abandoned:
            self.abandoned = True
        except (Exception, CheckpointException) as exc:  # DCP's error is a BaseException
            self.error = _why(exc)
            if self.commit is not None:  # every rank has given up on it: free the space at once
                shutil.rmtree(self.commit.tmp, ignore_errors=True)
        finally:
            self.seconds = time.perf_counter() - self.started
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once it has ended (within `timeout` seconds, if given)."""
        return self._done.wait(timeout)

    def abandon(self) -> bool:
        """Never mark it complete (rank 0); False when that is too late: it already is."""
        return self.commit.abandon() if self.commit is not None else True


def _why(exc: BaseException) -> str:
    return first_line(exc) if not isinstance(exc, ValueError) else f"its manifest {exc}"


class Writer:
    """The snapshots of one run under OUT/snapshots, written by every rank together.

    Args:
        out: the run folder.
        keep: complete snapshots to keep (one in flight does not count).
        background: write in the background on a gloo group of its own (`--snapshot-async`).
        timeout_s: that group's timeout, as the training groups' (--hang-timeout).
        during_write: test hook, called on every rank as it starts writing its shards.
    """

    def __init__(self, out: str | Path, keep: int, background: bool, timeout_s: float | None = None,
                 during_write=None):
        self.out, self.keep, self.background = Path(out), keep, background
        self.snaps = self.out / "snapshots"
        self.during_write = during_write
        self.group = _io_group(timeout_s) if background else None
        self.names: list[str] | None = None
        self.inflight: Writing | None = None

    def settle(self, timeout: float | None = None) -> Writing | None:
        """Wait for the snapshot in flight; returns it once ended (None if none, or not within
        `timeout`: it stays in flight)."""
        w = self.inflight
        if w is None or not w.wait(timeout):
            return None
        self.inflight = None
        return w

    def save(self, step: int, model: nn.Module, optimizer, meta: dict, background: bool | None = None) \
            -> Writing:
        """Collective: start writing snapshot `step` (a snapshot in flight must be settled first).

        Args:
            meta: the manifest's run facts (`compat.run_facts`).
            background: this once, in the background or not (default: the writer's).
        Returns:
            the snapshot being written; ended when written synchronously.
        Raises:
            SnapshotError: on every rank, when the snapshot could not be started or (synchronous)
                written on some rank; the previous snapshot stays.
        """
        if self.inflight is not None:
            raise RuntimeError("a snapshot is still in flight: settle() it first")
        background = self.background if background is None else background
        started = time.perf_counter()
        rank = dist.get_rank()
        tmp = self.snaps / f".tmp-{folder_name(step)}"
        if self.names is None:
            self.names = _param_names(model)
        error = self._prepare(tmp, rank, step)
        state = None
        if not error:
            state, error = _state(model, optimizer, tmp, rank)
        self._agree(step, error, tmp)
        meta = {"step": step, **meta, "world_size": dist.get_world_size()}
        commit = Commit(tmp, self.snaps / folder_name(step), meta, self.names, self.keep, SafeReader) \
            if rank == 0 else None
        writing = Writing(step, started, commit)
        files = _Files(tmp, self.during_write)
        if background:
            forensics.doing(f"snapshot step {step}: copying to memory")
            future = dcp.async_save(state, storage_writer=files, process_group=self.group)
            threading.Thread(target=writing.finish, args=(future,), name=f"snapshot-{step}",
                             daemon=True).start()
            self.inflight = writing
            return writing
        forensics.doing(f"snapshot step {step}: writing")
        try:
            dcp.save(state, storage_writer=files)
        except (OSError, CheckpointException) as exc:
            error = first_line(exc)
        if not error:
            writing.finish()
            error = writing.error or ""
        self._agree(step, error, tmp)
        return writing

    def _prepare(self, tmp: Path, rank: int, step: int) -> str:
        """Rank 0 makes the folder (removing any a killed run left); all wait for it. "" or why not."""
        error = ""
        if rank == 0:
            try:
                self.snaps.mkdir(parents=True, exist_ok=True)
                for stale in self.snaps.glob(".tmp-*"):
                    shutil.rmtree(stale, ignore_errors=True)
                tmp.mkdir()
            except OSError as exc:
                error = first_line(exc)
        forensics.doing(f"snapshot step {step}: barrier before writing", waiting=True)
        dist.barrier()
        return error

    def _agree(self, step: int, error: str, tmp: Path) -> None:
        """Collective: raise on every rank if any rank failed, after removing the half-written folder.

        Raises:
            SnapshotError: naming the step, the folder and the first rank's reason.
        """
        forensics.doing(f"snapshot step {step}: agreeing that every rank wrote", waiting=True)
        flag = torch.tensor([1.0 if error else 0.0], device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0:
            return
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise SnapshotError(failure_line(step, self.snaps, error or "on another rank"))


def failure_line(step: int, snaps: Path, why: str) -> str:
    """The one line that says a snapshot could not be written, and what is kept."""
    kept = read_pointer(snaps)
    return (f"writing snapshot step {step} in {snaps} failed ({why}); "
            + (f"the previous snapshot ({kept}) is intact" if kept else "no snapshot is complete yet")
            + ": free space or make the folder writable, or choose another --out")


def _state(model: nn.Module, optimizer, tmp: Path, rank: int) -> tuple[dict | None, str]:
    """The state dict DCP writes (aliases of a tie left out), after this rank's RNG file; why not."""
    try:
        model_sd, optim_sd = state_dicts(model, optimizer)
        tied = aliases_of(model)
        write_atomic(tmp / f"rng_{rank}.json", json.dumps(rng_state(devices_of(model))))
    except OSError as exc:
        return None, first_line(exc)
    return {"model": stored(model_sd, tied), "optim": stored(optim_sd, tied)}, ""


def _param_names(model: nn.Module) -> list[str]:
    """Collective: every rank's parameter names, a tie's aliases left out (what params_sha256 covers)."""
    tied = aliases_of(model)
    mine = [name for name, _ in stored_params(model) if name not in tied]
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return sorted({name for part in parts for name in part})


_GROUP: list = []  # [the default group, the snapshot group made beside it]: one world's


def _io_group(timeout_s: float | None):
    """Collective, once per world: a gloo group over every rank, for background snapshots only.
    (Holding the default group keeps a later world's from taking its place unnoticed.)"""
    default = dist.distributed_c10d._get_default_group()
    if not _GROUP or _GROUP[0] is not default:
        kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
        _GROUP[:] = [default, dist.new_group(backend="gloo", **kwargs)]
    return _GROUP[1]


def save(out: str | Path, step: int, model: nn.Module, optimizer, meta: dict, keep: int = 2,
         loss_scaler=None) -> Path:
    """Collective, once: write snapshot `step` at once and return its folder (on every rank).

    For a run that snapshots over and over, keep one `Writer`. `loss_scaler`: fp16's, whose scale
    the manifest keeps.

    Raises:
        SnapshotError: on every rank, when any rank failed to write; the previous snapshot stays.
    """
    if loss_scaler is not None:
        meta = {**meta, "loss_scale": loss_scaler.state_dict()}
    Writer(out, keep, background=False).save(step, model, optimizer, meta)
    return Path(out) / "snapshots" / folder_name(step)
