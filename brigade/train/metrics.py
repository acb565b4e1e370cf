"""The one owner of a run's metrics: the writer (rank 0's `Metrics`, fanning each record out to its
sinks) and the reader of `OUT/metrics.jsonl` that plotting, the run, the event lines and the
benchmarks all use.

Sinks share one interface (`Sink`): metrics.jsonl (always), TensorBoard event files in
OUT/tensorboard (`--tensorboard`), and the console (a progress bar on a terminal, log lines
elsewhere). A record is a flat dict with a `step`; `Metrics` adds `time`. Three kinds:

    {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s",    a training step
     "samples", "mfu", "tflops"}  (`sampler.fingerprint` of its global batch: equal across
                 layouts on resume; `mfu` and `tflops` where the device's peak is known: train.mfu)
    {"step", "val_loss"}                                                  an evaluation
    {"step", "event", ...}        snapshot, first_step (attempt > 0: a restart), layout, ...
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Protocol

from tqdm import tqdm

from brigade.errors import BrigadeError
from brigade.fsutil import write_atomic
from brigade.train import trackers
from brigade.train.trackers import scalars

FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


class Sink(Protocol):
    """Where records go. `write` gets every record in order (with `time`); `close` ends the run's use."""

    def write(self, record: dict) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends each record to a JSON-lines file, flushed at once: a run that dies leaves every
    finished step on disk."""

    def __init__(self, path: Path):
        torn = path.is_file() and path.stat().st_size and not path.read_bytes().endswith(b"\n")
        self._file = open(path, "a", encoding="utf-8")
        if torn:  # a line cut short by a crash: start ours on a line of their own
            self._file.write("\n")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def require_tensorboard() -> None:
    """Check, before any work, that `--tensorboard` can write event files.

    Raises:
        BrigadeError: the tensorboard package (which torch.utils.tensorboard needs) is missing.
    """
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise BrigadeError("--tensorboard needs the tensorboard package: "
                           "pip install 'brigade[tensorboard]'") from None


class TensorBoardSink:
    """Every number of a record as a TensorBoard scalar at the record's step: `train/<key>` for a
    training step, `val/loss`, and `event/<name>/<key>` for an event, which is also logged as
    text under `events/<name>`. Flushed per record, like metrics.jsonl.

    Args:
        folder: where the event files go (OUT/tensorboard).
        purge_step: a resumed run's first step: TensorBoard hides what an earlier attempt logged
            from this step on, as `trim` does for metrics.jsonl.
    """

    def __init__(self, folder: Path, purge_step: int | None = None):
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(folder), purge_step=purge_step)

    def write(self, record: dict) -> None:
        step, wall = record["step"], record.get("time")
        event = record.get("event")
        if event is not None:
            text = ", ".join(f"{k} = {v}" for k, v in record.items() if k not in ("time", "event"))
            self._writer.add_text(f"events/{event}", text, step, walltime=wall)
        for tag, value in scalars(record):
            self._writer.add_scalar(tag, value, step, walltime=wall)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class Console:
    """What the user sees: a progress bar on a terminal (stdout: workers' stderr goes to log
    files), else a log line every `log_every` steps; validation losses always."""

    def __init__(self, total_steps: int, log_every: int = 25):
        self.total = total_steps
        self.log_every = log_every
        self._last_val = None
        self._bar = None
        if sys.stdout.isatty():
            self._bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True,
                             file=sys.stdout)

    def write(self, record: dict) -> None:
        if "event" in record:
            return
        if "val_loss" in record:
            self._last_val = record["val_loss"]
            self._say(f"step {record['step']:>6}  val loss {record['val_loss']:.4f}")
            return
        if self._bar is not None:
            self._bar.n = record["step"]
            post = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}",
                    **({"MFU": f"{100 * record['mfu']:.1f}%"} if "mfu" in record else {})}
            if self._last_val is not None:
                post["val"] = f"{self._last_val:.3f}"
            self._bar.set_postfix(post, refresh=True)
        elif record["step"] % self.log_every == 0 or record["step"] == self.total:
            mfu = f"  MFU {100 * record['mfu']:.1f}%" if "mfu" in record else ""
            print(f"step {record['step']:>6}/{self.total}  loss {record['loss']:.4f}  "
                  f"lr {record['lr']:.2e}  {record['tokens_per_s']:.0f} tok/s{mfu}  "
                  f"{record['step_time_s'] * 1e3:.0f} ms/step", flush=True)

    def _say(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class Metrics:
    """Rank 0's record of a run. With `out=None` (other ranks) it does nothing.

    Used as a (re-entrant) context manager: the sinks are open inside it. Every record gets
    `time`, the wall clock (Unix seconds) when it was written: the gaps between step records
    time the whole training loop (callbacks, metrics, collectives), which `step_time_s` alone
    does not.

    Args:
        out: the run folder (metrics.jsonl, tensorboard/), or None on ranks that do not write.
        total_steps: the run's last step, for the progress bar and log lines.
        log_every: steps between log lines when stdout is not a terminal.
        tensorboard: also write TensorBoard event files in out/tensorboard.
        log: --log's trackers (`config.validate.logs`): tensorboard, wandb, mlflow
            (`train.trackers`).

    Raises:
        BrigadeError: a tracker whose package is missing (see `require_tensorboard`,
            `trackers.require`).
    """

    def __init__(self, out: str | Path | None, total_steps: int, log_every: int = 25,
                 tensorboard: bool = False, log: tuple[str, ...] = ()):
        self.out = Path(out) if out else None
        self.total = total_steps
        self.log_every = log_every
        self.tensorboard = tensorboard or "tensorboard" in log
        self.trackers = tuple(name for name in log if name != "tensorboard")
        if self.out is not None and self.tensorboard:
            require_tensorboard()
        if self.out is not None:
            trackers.require(self.trackers)
        self._sinks: list[Sink] = []
        self._depth = 0

    def __enter__(self) -> Metrics:
        self._depth += 1
        if self.out is not None and self._depth == 1:
            self.out.mkdir(parents=True, exist_ok=True)
            self._sinks = self._open()
        return self

    def _open(self) -> list[Sink]:
        sinks: list[Sink] = []
        if self.tensorboard:
            # After a resume metrics.jsonl ends at the snapshot's step (`trim`): hide from
            # TensorBoard whatever the attempt that died logged after it.
            done = last_step(self.out)
            sinks.append(TensorBoardSink(self.out / TENSORBOARD_DIR, purge_step=done + 1 if done else None))
        sinks += [trackers.SINKS[name](self.out) for name in self.trackers]
        return [JsonlSink(self.out / FILE), *sinks, Console(self.total, self.log_every)]

    def write(self, record: dict) -> None:
        """Hand `record` (stamped with `time`) to every sink; nothing outside the context."""
        if not self._sinks:
            return
        record = {**record, "time": time.time()}
        for sink in self._sinks:
            sink.write(record)

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth:
            return
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            sink.close()


def read_records(out: str | Path, missing_ok: bool = False) -> list[dict]:
    """Every complete record of `out/metrics.jsonl`, in order. A line cut short by a crash (or
    still being written by a running job) is skipped.

    Args:
        out: the run folder.
        missing_ok: return [] when there is no metrics.jsonl (a run that has not logged yet).

    Raises:
        BrigadeError: no metrics.jsonl in `out` (unless `missing_ok`).
    """
    path = Path(out) / FILE
    if not path.is_file():
        if missing_ok:
            return []
        raise BrigadeError(f"{out} has no {FILE}: give the --out folder of a training run")
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


def training(records: list[dict]) -> list[dict]:
    """The records of optimizer steps (those with a `loss`)."""
    return [r for r in records if "loss" in r]


def validation(records: list[dict]) -> list[dict]:
    """The records of evaluations (those with a `val_loss` that is not None)."""
    return [r for r in records if r.get("val_loss") is not None]


def events(records: list[dict], name: str) -> list[dict]:
    """The records of event `name` (snapshot, first_step, ...)."""
    return [r for r in records if r.get("event") == name]


def last_step(out: str | Path) -> int:
    """The step of the last training record in `out/metrics.jsonl`; 0 if none (or no file)."""
    steps = training(read_records(out, missing_ok=True))
    return steps[-1]["step"] if steps else 0


def trim(out: str | Path, step: int) -> None:
    """Drop the records past `step` (and torn lines) from `out/metrics.jsonl`, atomically: on a
    resume from the snapshot of `step` they belong to the attempt that died. No file: nothing."""
    path = Path(out) / FILE
    if not path.is_file():
        return
    keep = [r for r in read_records(out) if r["step"] <= step]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in keep))


def loop_seconds(records: list[dict], skip: int = 0) -> list[float]:
    """Seconds between consecutive training-step records, after the first `skip` steps.

    A gap with a validation record inside it is left out: it times evaluation, not a step.
    """
    out, prev = [], None
    for r in records:
        if "loss" in r and "time" in r and r["step"] > skip:
            if prev is not None and r["step"] == prev["step"] + 1:
                out.append(r["time"] - prev["time"])
            prev = r
        elif "val_loss" in r:
            prev = None
    return out
