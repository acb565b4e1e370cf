"""Supervising a run under the elastic agent: launch it, and say in one line what the agent does.

`launch_with_events` starts the workers through `brigade.launcher.agent.launch` and keeps the agent's
raw log in a file. torchelastic reports a dead worker with pages of frames. brigade turns each
event into one line, e.g.

    rank 1 died (SIGKILL) at step 7 — restarting 1/2 from snapshot step 5

and keeps the agent's own log in OUT/logs/agent.log and every worker's
stderr under OUT/logs/ for whoever needs them. In an elastic run (--nnodes MIN:MAX) each change
of the world is one line on the nodes that were there, and a `layout` record in metrics.jsonl:

    node 1 lost at step 12 — continuing on 1 node as dp 1 × pp 2 with gradient accumulation 2
    (global batch 32 unchanged) from snapshot step 10
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import socket
from pathlib import Path

import torch.distributed as dist

from brigade import forensics
from brigade.config import Launched, RunConfig, resolve_layout
from brigade.config.elastic import accumulation
from brigade.launcher import agent
from brigade.launcher.rendezvous import LaunchSpec
from brigade.snapshot.format import latest_step
from brigade.train import metrics

_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
_RESTART = re.compile(r"(\d+)/(\d+) attempts left")


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
            step = metrics.last_step(self.out) + 1
            snap = latest_step(self.out)
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
    """`agent.launch` with one readable line per failure or restart; raw logs in OUT/logs."""
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
        spec = LaunchSpec.from_parallel(p, port=port, log_dir=str(logs), quiet=False)
        return agent.launch(fn, spec, cfg, *args)
    finally:
        for lg, level, propagate, handlers in saved:
            lg.setLevel(level)
            lg.propagate = propagate
            lg.handlers = handlers
        file_handler.close()


# --- elastic runs: one line and one record per change of the world -----------------------------

def node_name() -> str:
    """This node's name in layout records: brigade's --node-rank under its own launcher (the
    agent sets BRIGADE_NODE for its workers), else the host's name (torchrun names no node the
    same in every round)."""
    return os.environ.get("BRIGADE_NODE") or socket.gethostname()


def this_round(cfg: RunConfig) -> RunConfig:
    """An elastic run's configuration for the world this round of the rendezvous formed: dp (and
    so the accumulation) from the process group, by `config.resolve_layout`. Else `cfg` itself."""
    p = cfg.parallel
    if not p.min_nodes:
        return cfg
    local = int(os.environ.get("LOCAL_WORLD_SIZE", p.nproc))
    world = Launched(dist.get_world_size(), local, "the elastic agent")
    return resolve_layout(dataclasses.replace(cfg, parallel=dataclasses.replace(p, dp=0)), world)


def layout_record(cfg: RunConfig, resumed: int) -> tuple[dict | None, str | None]:
    """An elastic run's `layout` record for this world and, if it differs from the previous
    world's, its line (not elastic: None, None).

    Collective (every rank calls it, before metrics are trimmed): rank 0 compares with the last
    `layout` record in metrics.jsonl and tells everyone; the line is for the nodes that were there.
    """
    p, out = cfg.parallel, Path(cfg.train.out)
    if not p.min_nodes:
        return None, None
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, node_name())
    nodes = sorted(set(names), key=lambda n: (len(n), n))
    count = dist.get_world_size() // int(os.environ.get("LOCAL_WORLD_SIZE", p.nproc))
    record = {"step": resumed, "event": "layout", "nodes": nodes, "n_nodes": max(count, 1), "dp": p.dp,
              "pp": p.pp, "grad_accum": accumulation(cfg, p.dp), "batch_size": cfg.train.batch_size}
    said = [record, None, []]
    if dist.get_rank() == 0 and (out / "metrics.jsonl").is_file():
        records = metrics.read_records(out)
        before = metrics.events(records, "layout")
        last = max([r["step"] for r in metrics.training(records)], default=0)
        if before and (before[-1]["n_nodes"], before[-1]["nodes"]) != (record["n_nodes"], nodes):
            said = _change(record, before[-1], last, resumed)
    dist.broadcast_object_list(said, src=0)
    record, line, was_there = said
    return record, (line if node_name() in was_there else None)


def _change(record: dict, before: dict, last: int, resumed: int) -> list:
    """[record with the change, its line, the nodes of the previous world]."""
    lost = record["n_nodes"] < before["n_nodes"]
    gone = [n for n in (before["nodes"] if lost else record["nodes"])
            if n not in (record["nodes"] if lost else before["nodes"])]
    delta = abs(record["n_nodes"] - before["n_nodes"])
    who = (f"node{'s' if len(gone) > 1 else ''} {', '.join(gone)}" if len(gone) == delta
           else f"{delta} node{'s' if delta > 1 else ''}")
    at = last + 1 if lost else last  # lost during the step after the last logged; joined after it
    n = record["n_nodes"]
    line = (f"brigade: {who} {'lost' if lost else 'joined'} at step {at} — continuing on {n} "
            f"node{'s' if n > 1 else ''} as dp {record['dp']} × pp {record['pp']} with gradient "
            f"accumulation {record['grad_accum']} (global batch {record['batch_size']} unchanged) "
            + (f"from snapshot step {resumed}" if resumed else "from the start"))
    record = {**record, "change": "lost" if lost else "joined", "at_step": at, "who": gone or who}
    return [record, line, before["nodes"]]
