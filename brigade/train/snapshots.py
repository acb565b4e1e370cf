"""When a run takes its snapshots, and what becomes of one in flight: the trainer's side.

After each step every rank adds three facts to one all-reduce (so all ranks act alike):

    stop       a stop signal (SIGTERM) came: finish, snapshot, leave
    due        --snapshot-minutes of wall time have passed since the last snapshot began
    failed     a snapshot written in the background failed on this rank

A snapshot is taken after every --snapshot-every-th step, when one is due by time, and at the
end. In the background (--snapshot-async, the default) the step that takes it waits only for
the copy to memory (`snapshot.writer`); the next snapshot waits for the last one.

A failed snapshot (a full or read-only disk) is said in one line; --on-snapshot-error stop ends
the run there (on every rank), warn trains on. Either way only complete snapshots are ever
marked complete, and the newest of them is the one a restart resumes from.

On a stop signal a snapshot in flight is given half of --stop-grace (from the signal) to finish:
finished, the run also writes the step it stopped at and leaves; not finished, it is abandoned
(never marked complete) and the run leaves at once, resumable from the newest complete one.
Rank 0 says which, and the metrics record it (event "stop").
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from brigade import forensics
from brigade.config import RunConfig
from brigade.launcher import agent
from brigade.snapshot.compat import run_facts
from brigade.snapshot.format import SnapshotError, folder_name, latest_step, read_pointer
from brigade.snapshot.writer import Writer, Writing, failure_line


class Snapshots:
    """A run's snapshots: `after_step` is the trainer's callback, `final` the last one's folder.

    Args:
        trainer: the `Trainer` whose state is saved.
        cfg: the run's configuration (its train section decides when and how).
        vocab: a GPT's characters, kept in the manifest; None for other models.
        during_write: test hook (`FaultInjector.during_snapshot`), called with the step on every
            rank as it starts writing its shards.
        data_sha: the token shard set's hash, kept in the manifest.
    """

    def __init__(self, trainer, cfg: RunConfig, vocab: str | None, device: torch.device,
                 during_write=None, data_sha: str | None = None):
        t = cfg.train
        self.trainer, self.cfg, self.vocab, self.device, self.data_sha = trainer, cfg, vocab, device, data_sha
        self.writing_step = 0
        hook = (lambda: during_write(self.writing_step)) if during_write is not None else None
        self.writer = Writer(t.out, t.keep, background=t.snapshot_async,
                             timeout_s=cfg.parallel.hang_timeout, during_write=hook)
        self.last_start = time.monotonic()
        self.last_step = -1  # the step of the last snapshot taken (in flight or complete)
        self.written_part: int | None = None  # the newest snapshot this rank's part was written of
        self.rank = dist.get_rank()

    def take(self, background: bool | None = None, must: bool = False) -> Writing | None:
        """Collective: snapshot the trainer's current step (after the one in flight has ended).

        Logs a "snapshot" event: `seconds` is how long the step waited (the stall). A snapshot
        that cannot even be started (or, synchronous, written) follows --on-snapshot-error.

        Args:
            background: this once, in the background or not (default: --snapshot-async).
            must: raise on failure whatever the policy (the last snapshot of a run).
        Raises:
            SnapshotError: on every rank, under --on-snapshot-error stop or `must`.
        """
        tr = self.trainer
        start = time.perf_counter()
        self._settle()
        step = self.writing_step = tr.state.step
        facts = run_facts(self.cfg, tr.sampler.cursor, tr.sampler.epoch, self.vocab, tr.engine.balance,
                          self.data_sha)
        if tr.scaler is not None:
            facts["loss_scale"] = tr.scaler.state_dict()
        self.last_start, self.last_step = time.monotonic(), step
        background = self.cfg.train.snapshot_async if background is None else background
        try:
            writing = self.writer.save(step, tr.model, tr.optimizer, facts, background=background)
        except SnapshotError as exc:
            if must or self.cfg.train.on_snapshot_error == "stop":
                raise
            self._warn(str(exc), step)
            return None
        tr.metrics.write({"step": step, "event": "snapshot", "seconds": time.perf_counter() - start,
                          "async": background})
        if not background and self.rank == 0:
            self._written(writing)
        return writing

    def after_step(self, tr, record: dict) -> None:
        """The trainer's callback: agree on stop, due and failed; act on them."""
        if "loss" not in record:
            return
        t = self.cfg.train
        ended = self.writer.settle(0) if self.writer.inflight is not None else None
        due = time.monotonic() - self.last_start >= t.snapshot_minutes * 60
        # In flight is agreed too: rank 0's snapshot ends with its commit, after the others' DCP
        # has ended, so one rank may still hold it where the rest have settled theirs.
        flags = torch.tensor([float(agent.stop_requested()), float(due),
                              float(ended is not None and ended.error is not None),
                              float(self.writer.inflight is not None)], device=self.device)
        forensics.doing(f"step {record['step']}: allreduce stop flag", waiting=True)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, due, failed, inflight = (bool(v) for v in flags.tolist())
        if ended is not None:
            self._report(ended, agreed_failed=failed)
        elif failed:
            self._fail_everywhere(None)
        step = record["step"]
        if stop:  # preempted: this step is done; keep it if the grace allows, and stop
            self._on_stop(step, inflight)
            tr.stop_requested = True
        elif step < t.max_steps and ((t.snapshot_every and step % t.snapshot_every == 0) or due):
            self.take()

    def final(self) -> Path | None:
        """Collective, at the end: the last snapshot in flight ended, the current step's written if
        it is not yet (not after a stop: `_on_stop` did); the newest complete snapshot's folder."""
        tr = self.trainer
        if not tr.stop_requested:
            self._settle()
            if self.last_step != tr.state.step:
                self.take(background=False, must=True)
        # Every rank has agreed after rank 0's last commit, so LATEST is current; rank 0 checksummed
        # that snapshot as it committed it: no need to read it all again here, on every rank.
        name = read_pointer(self.writer.snaps)
        return self.writer.snaps / name if name else None

    def settle_quietly(self, limit_s: float = 60.0) -> None:
        """Wait for the newest snapshot to be complete or failed, without agreeing on anything (a
        run that is ending on an error: its newest good snapshot should be on disk when it names
        it).

        Rank 0 holds a snapshot in flight until its commit has marked it complete; every other
        rank only until its own part is written (DCP is done), and may have let go of it steps
        ago. So those ranks also wait (at most `limit_s` seconds) until LATEST names the newest
        snapshot their part of which was written, or rank 0 has removed its half-written folder
        (the commit failed): every rank then names the same newest snapshot.
        """
        w = self.writer.settle(None)
        if w is not None and w.error is None and not w.abandoned:
            self.written_part = w.step
            if self.rank == 0:
                self._written(w)
        step = self.written_part
        if self.rank == 0 or step is None:
            return
        snaps = self.writer.snaps
        pending = [snaps / f".tmp-{folder_name(step)}", snaps / folder_name(step)]
        deadline = time.monotonic() + limit_s
        while (latest_step(self.cfg.train.out) or -1) < step and any(p.exists() for p in pending) \
                and time.monotonic() < deadline:
            time.sleep(0.02)

    def landed(self, limit_s: float = 120.0) -> None:
        """Not collective: wait until the snapshot in flight is complete on disk (LATEST names it)
        or has failed, for at most `limit_s` seconds (for a fault injected at a step)."""
        w = self.writer.inflight
        if w is None:
            return
        deadline = time.monotonic() + limit_s
        w.wait(limit_s)
        while w.error is None and not w.abandoned and (latest_step(self.cfg.train.out) or -1) < w.step \
                and time.monotonic() < deadline:
            time.sleep(0.02)

    def _settle(self) -> None:
        """Collective: the snapshot in flight (if any) ended, and reported alike on every rank."""
        forensics.doing(f"snapshot step {self.last_step}: waiting for it to be written", waiting=True)
        w = self.writer.settle(None)
        failed = torch.tensor([float(w is not None and w.error is not None)], device=self.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if w is not None:
            self._report(w, agreed_failed=bool(failed.item()))
        elif failed.item():
            self._fail_everywhere(None)

    def _report(self, w: Writing, agreed_failed: bool | None = None) -> None:
        """A snapshot that ended: logged when complete; a failure said (and acted on) on every rank."""
        if w.error is None and not w.abandoned:
            self.written_part = w.step
            if self.rank == 0:
                self._written(w)
            if not agreed_failed:
                return
        self._fail_everywhere(w)

    def _written(self, w: Writing) -> None:
        self.trainer.metrics.write({"step": self.trainer.state.step, "event": "snapshot_written",
                                    "snapshot_step": w.step, "seconds": w.seconds})

    def _fail_everywhere(self, w: Writing | None) -> None:
        """A snapshot failed on some rank: every rank stops (--on-snapshot-error stop) or trains on.

        Raises:
            SnapshotError: under stop, on every rank: rank 0 names the cause.
        """
        step = w.step if w is not None else self.last_step
        why = w.error if w is not None and w.error else "on another rank"
        line = failure_line(step, self.writer.snaps, why)
        if self.cfg.train.on_snapshot_error == "stop":
            raise SnapshotError(line)
        self._warn(line, step)

    def _warn(self, line: str, step: int) -> None:
        if self.rank == 0:
            print(f"brigade: warning: {line}; training goes on (--on-snapshot-error warn)", flush=True)
            self.trainer.metrics.write({"step": self.trainer.state.step, "event": "snapshot_failed",
                                        "snapshot_step": step, "error": line})

    def _on_stop(self, step: int, inflight: bool) -> None:
        """Collective, on a stop signal: the snapshot in flight, given half of --stop-grace from the
        signal, finished or abandoned (rank 0's decides, as it commits); then, unless abandoned,
        this step's snapshot, written at once.

        `inflight` is what every rank agreed: some rank still holds a snapshot in flight. Each
        rank branches on that, not on its own (rank 0 holds its snapshot until the commit ends,
        the others only until DCP does): a rank that branched alone called other collectives than
        the rest, and the run hung."""
        w, outcome, start = self.writer.inflight, "none", time.perf_counter()
        if inflight:
            half = self.cfg.train.stop_grace / 2
            ended = w is None or w.wait(max(half - agent.seconds_since_stop(), 0.0))
            abandoned = not ended and w.abandon()  # False: it was committed in the meantime
            flag = torch.tensor([float(self.rank == 0 and abandoned)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            outcome = "abandoned" if flag.item() else "finished"
            if outcome == "finished":
                self._settle()  # rank 0 has committed: the others' DCP ends as good as now
        waited = time.perf_counter() - start
        if self.rank == 0:
            self.trainer.metrics.write({"step": step, "event": "stop", "outcome": outcome,
                                        "in_flight": w.step if w is not None else None, "waited_s": waited})
            print(_stop_line(w, outcome, waited, step, self.cfg.train.stop_grace,
                             self.writer.snaps), flush=True)
        if outcome != "abandoned" and self.last_step != step:
            self.take(background=False, must=True)


def _stop_line(w: Writing | None, outcome: str, waited: float, step: int, grace: float,
               snaps: Path) -> str:
    """What rank 0 says of a stop: what became of the snapshot in flight, and what is written."""
    if w is None:
        return f"brigade: stop signal: writing the snapshot of step {step} before leaving"
    if outcome == "finished":
        return (f"brigade: stop signal: the snapshot of step {w.step}, being written, was finished "
                f"({waited:.1f} s); writing step {step}'s before leaving")
    kept = latest_step(snaps.parent)  # LATEST, not verified again: within the grace, time counts
    newest = f"step {kept}" if kept is not None else "none"
    return (f"brigade: stop signal: the snapshot of step {w.step}, being written, was abandoned: not "
            f"finished within {grace / 2:g} s (half of --stop-grace {grace:g}); the newest complete "
            f"snapshot is {newest}; step {step} is not saved")
