"""What the user sees while training: metrics.jsonl, a progress bar on a terminal, log lines elsewhere."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tqdm import tqdm


class Metrics:
    """Rank 0's record of a run. With `out=None` (other ranks) it does nothing.

    Every record is appended to `out/metrics.jsonl` and flushed at once, so a run
    that dies leaves every finished step on disk. Each gets `time`, the wall clock (Unix
    seconds) when it was written: the gaps between step records time the whole training
    loop (callbacks, metrics, collectives), which `step_time_s` alone does not.
    """

    def __init__(self, out: str | None, total_steps: int, log_every: int = 25):
        self.out = Path(out) if out else None
        self.total = total_steps
        self.log_every = log_every
        self._file = None
        self._bar = None
        self._last_val = None
        self._depth = 0

    def __enter__(self) -> Metrics:
        self._depth += 1
        if self.out is not None and self._depth == 1:
            self.out.mkdir(parents=True, exist_ok=True)
            self._file = open(self.out / "metrics.jsonl", "a", encoding="utf-8")
            if sys.stdout.isatty():  # stdout: workers' stderr goes to log files
                self._bar = tqdm(total=self.total, desc="train", unit="step", dynamic_ncols=True,
                                 file=sys.stdout)
        return self

    def write(self, record: dict) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps({**record, "time": time.time()}) + "\n")
        self._file.flush()
        if "event" in record:
            return
        if "val_loss" in record:
            self._last_val = record["val_loss"]
            self._say(f"step {record['step']:>6}  val loss {record['val_loss']:.4f}")
            return
        if self._bar is not None:
            self._bar.n = record["step"]
            post = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}"}
            if self._last_val is not None:
                post["val"] = f"{self._last_val:.3f}"
            self._bar.set_postfix(post, refresh=True)
        elif record["step"] % self.log_every == 0 or record["step"] == self.total:
            print(f"step {record['step']:>6}/{self.total}  loss {record['loss']:.4f}  "
                  f"lr {record['lr']:.2e}  {record['tokens_per_s']:.0f} tok/s  "
                  f"{record['step_time_s'] * 1e3:.0f} ms/step", flush=True)

    def _say(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None


def read_records(out: str | Path) -> list[dict]:
    """Every complete record of `out/metrics.jsonl`, in order (a line cut short by a crash is skipped).

    Raises:
        FileNotFoundError: the folder has no metrics.jsonl.
    """
    records = []
    for line in (Path(out) / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


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
