"""Readable lines for what the elastic agent does, raw logs to a file.

torchelastic reports a dead worker with pages of frames. brigade turns each
event into one line, e.g.

    rank 1 died (SIGKILL) at step 7 — restarting 1/2 from snapshot step 5

and keeps the agent's own log in OUT/logs/agent.log and every worker's
stderr under OUT/logs/ for whoever needs them.
"""

from __future__ import annotations

import json
import logging
import re
import signal
from pathlib import Path

from brigade import dist as bdist
from brigade import forensics
from brigade.train.snapshot import POINTER

_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
_RESTART = re.compile(r"(\d+)/(\d+) attempts left")


def _last_step(out: Path) -> int:
    path = out / "metrics.jsonl"
    last = 0
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if "loss" in r:
                last = r["step"]
    return last


def snapshot_step(out: Path) -> int | None:
    pointer = out / "snapshots" / POINTER
    if not pointer.is_file():
        return None
    m = re.search(r"(\d+)", pointer.read_text())
    return int(m[1]) if m else None


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class EventLines(logging.Handler):
    """Turns the agent's failure and restart records into one line each, on stdout."""

    def __init__(self, out: Path, say=print):
        super().__init__(logging.INFO)
        self.out = out
        self.say = say
        self.failed: list[tuple[int, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if m := _FAILED.search(msg):
            self.failed.append((int(m[2]), int(m[1])))
        elif (m := _RESTART.search(msg)) and "will restart" in msg:
            left, total = int(m[1]), int(m[2])
            attempt = total - left + 1
            step = _last_step(self.out) + 1
            snap = snapshot_step(self.out)
            who = ", ".join(f"rank {r} died ({describe_exit(c)})" for r, c in self.failed) or \
                "a worker stopped"
            if any(c == forensics.EXIT_CODE for _, c in self.failed):
                who = "the run hung (report above)"
            source = f"from snapshot step {snap}" if snap is not None else "from the start"
            self.say(f"brigade: {who} at step {step} — restarting {attempt}/{total} {source}", flush=True)
            self.failed.clear()


def _loggers() -> list[logging.Logger]:
    """torchelastic's loggers (each sets its own level at import) and torch's spawn logger."""
    import torch.distributed.elastic.agent.server.api  # noqa: F401  (create them now)

    names = [n for n in logging.Logger.manager.loggerDict if n.startswith("torch.distributed.elastic")]
    return [logging.getLogger(n) for n in ["torch.multiprocessing.spawn", *sorted(set(names))]]


def launch_with_events(fn, cfg, *args, port: int | None = None) -> dict:
    """`bdist.launch` with one readable line per failure or restart; raw logs in OUT/logs."""
    out = Path(cfg.train.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(logs / "agent.log")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    events = EventLines(out)
    loggers = _loggers()
    saved = [(lg, lg.level, lg.propagate, list(lg.handlers)) for lg in loggers]
    for lg in loggers:
        lg.handlers = [file_handler, events]
        lg.setLevel(logging.INFO)
        lg.propagate = False
    try:
        p = cfg.parallel
        return bdist.launch(fn, p.nproc, cfg, *args, max_restarts=p.max_restarts, port=port,
                            log_dir=str(logs), threads_per_proc=p.threads, quiet=False,
                            nnodes=p.nnodes, node_rank=p.node_rank, rdzv_endpoint=p.rdzv_endpoint,
                            local_addr=p.local_addr)
    finally:
        for lg, level, propagate, handlers in saved:
            lg.setLevel(level)
            lg.propagate = propagate
            lg.handlers = handlers
        file_handler.close()
