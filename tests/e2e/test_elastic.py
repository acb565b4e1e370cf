"""Elastic runs: two `brigade train --nnodes 1:2` agents on loopback, one process each (dp 2 × pp 1).

One agent (its whole process group) is killed for good after a snapshot: the other goes on as
dp 1 with twice the gradient accumulation, and every step's loss stays the uninterrupted run's
(and with two processes a node under --shard 2: HSDP dp 4, then FSDP dp 2).
Then the killed node comes back with the same command and the job grows to it again. The seconds
from the loss to the next step, and from the return to the first step with it, are printed
(`pytest -s`).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import TINY, losses, train
from tests.e2e.test_train import _wait_until_listening

pytestmark = [pytest.mark.timeout(600), pytest.mark.full]
# Many steps: node 0 alone must still be training when node 1 has started again (seconds).
RUN = ["--max-steps", "300", "--snapshot-every", "10", "--eval-every", "1000", "--sample-tokens", "0",
       "--batch-size", "16"]


def _records(out: Path) -> list[dict]:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _wait_for(out: Path, what, seconds: float = 180) -> list[dict]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        rows = _records(out)
        if what(rows):
            return rows
        time.sleep(0.1)
    raise AssertionError(f"waited {seconds} s; metrics: {_records(out)[-5:]}")


def _layouts(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("event") == "layout"]


def _steps_after(rows: list[dict], record: dict) -> list[dict]:
    later = rows[rows.index(record) + 1:]
    return [r for r in later if "loss" in r]


class Nodes:
    """Two `brigade train` agents meeting at one loopback endpoint, each in its own session."""

    def __init__(self, out: Path, nproc: int = 1, extra: tuple[str, ...] = ()):
        from brigade.host.net import free_port

        self.port = free_port()
        self.flags = ["train", "--out", str(out), *TINY, *RUN, *extra, "--nnodes", "1:2",
                      "--nproc", str(nproc),
                      "--max-restarts", "2", "--rdzv-endpoint", f"127.0.0.1:{self.port}",
                      "--rdzv-last-call", "3", "--rdzv-timeout", "60"]
        self.logs = out.parent
        self.procs: dict[int, subprocess.Popen] = {}

    def start(self, k: int) -> subprocess.Popen:
        """Node k's agent; its output goes to files, as a pipe nobody reads while the test waits
        for the other node could fill and block this node in a write."""
        cmd = [sys.executable, "-m", "brigade", *self.flags, "--node-rank", str(k)]
        n = len(list(self.logs.glob(f"node{k}-*.out")))  # a node started again keeps its first logs
        logs = [self.logs / f"node{k}-{n}.{x}" for x in ("out", "err")]
        with open(logs[0], "w") as out, open(logs[1], "w") as err:
            self.procs[k] = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True,
                                             start_new_session=True, stdout=out, stderr=err)
        self.procs[k].logs = logs  # type: ignore[attr-defined]
        if k == 0:
            _wait_until_listening(self.port)  # node 0 hosts the rendezvous store
        return self.procs[k]

    def kill(self, k: int) -> float:
        """Node k goes down for good: SIGKILL to its agent and workers. Returns the time."""
        os.killpg(self.procs[k].pid, signal.SIGKILL)
        self.procs[k].wait(timeout=60)
        return time.time()

    def wait(self, k: int, timeout: float = 400) -> tuple[str, str]:
        """Node k's exit: its stdout and stderr."""
        self.procs[k].wait(timeout=timeout)
        return tuple(path.read_text() for path in self.procs[k].logs)

    def finish(self, k: int) -> str:
        out, err = self.wait(k)
        assert self.procs[k].returncode == 0, out[-2000:] + err[-3000:]
        return out

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)


# A session fixture is made once per pytest-xdist worker: both tests that compare with `reference`
# run on one worker (one group), so the uninterrupted run is trained once.
WITH_REFERENCE = pytest.mark.xdist_group("elastic-reference")


@pytest.fixture(scope="session")  # not module: xdist interleaves modules, which tears it down
def reference(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted run on one node: dp 2, the same global batch."""
    out = tmp_path_factory.mktemp("elastic") / "reference"
    result = train(out, *RUN, "--nproc", "2", timeout=400)
    assert result.returncode == 0, result.stderr[-2000:]
    return losses(out)


def _same_losses(out: Path, reference: dict[int, float]) -> None:
    got = losses(out)
    assert sorted(got) == sorted(reference)
    worst = max(abs(got[s] - reference[s]) for s in reference)
    assert worst <= 1e-5, f"largest per-step loss difference {worst:.2e}"


def _written_after(rows: list[dict], record: dict) -> list[dict]:
    """The snapshots reported complete after `record` (they are written in the background: one
    taken at step 10 may still be on its way at step 13)."""
    return [r for r in rows[rows.index(record) + 1:] if r.get("event") == "snapshot_written"]


def _lose_node_1(nodes: Nodes, out: Path) -> tuple[list[dict], float]:
    """Both nodes train past a complete snapshot; node 1 is killed; node 0 resumes alone."""
    nodes.start(0)
    nodes.start(1)
    rows = _wait_for(out, lambda rows: _layouts(rows) and _layouts(rows)[-1]["n_nodes"] == 2
                     and len(_steps_after(rows, _layouts(rows)[-1])) >= 12
                     and _written_after(rows, _layouts(rows)[-1]))  # past a complete snapshot
    killed = nodes.kill(1)
    rows = _wait_for(out, lambda rows: _layouts(rows)[-1].get("change") == "lost"
                     and _steps_after(rows, _layouts(rows)[-1]))
    first = _steps_after(rows, _layouts(rows)[-1])[0]
    print(f"\nnode lost → next step: {first['time'] - killed:.1f} s")
    return rows, first["time"] - killed


@WITH_REFERENCE
def test_a_node_lost_for_good(tmp_path, reference):
    out = tmp_path / "elastic"
    nodes = Nodes(out)
    try:
        rows, _ = _lose_node_1(nodes, out)
        said = nodes.finish(0)
    finally:
        nodes.close()
    lost = _layouts(rows)[-1]
    assert (lost["n_nodes"], lost["dp"], lost["pp"], lost["grad_accum"]) == (1, 1, 1, 2)
    assert (f"brigade: node 1 lost at step {lost['at_step']} — continuing on 1 node as dp 1 × pp 1 with "
            f"gradient accumulation 2 (global batch 16 unchanged) from snapshot step {lost['step']}") in said
    assert lost["step"] >= 10 and lost["step"] % 10 == 0
    _same_losses(out, reference)


@WITH_REFERENCE
def test_a_sharded_run_loses_a_node_and_keeps_sharding(tmp_path, reference):
    """Two processes a node, --shard 2: dp 4 (2 replicas of 2 shards, HSDP) on both nodes, then dp 2
    (one shard group, FSDP) on node 0 with twice the accumulation; every loss as the DDP run's."""
    out = tmp_path / "elastic-sharded"
    nodes = Nodes(out, nproc=2, extra=("--shard", "2"))
    try:
        rows, _ = _lose_node_1(nodes, out)
        nodes.finish(0)
    finally:
        nodes.close()
    layouts = _layouts(rows)  # node 0 may begin alone (dp 2) and grow when node 1 arrives
    assert (layouts[-2]["n_nodes"], layouts[-2]["dp"]) == (2, 4)
    lost = layouts[-1]
    assert (lost["n_nodes"], lost["dp"], lost["grad_accum"]) == (1, 2, 2)
    _same_losses(out, reference)


@WITH_REFERENCE
def test_a_node_that_returns_is_grown_back_to(tmp_path, reference):
    out = tmp_path / "elastic"
    nodes = Nodes(out)
    try:
        _lose_node_1(nodes, out)
        back = time.time()
        nodes.start(1)  # the same command
        rows = _wait_for(out, lambda rows: _layouts(rows)[-1].get("change") == "joined"
                         and _steps_after(rows, _layouts(rows)[-1]))
        first = _steps_after(rows, _layouts(rows)[-1])[0]
        print(f"node back → first step with it: {first['time'] - back:.1f} s")
        said = nodes.finish(0)
        nodes.finish(1)
    finally:
        nodes.close()
    joined = _layouts(rows)[-1]
    assert (joined["n_nodes"], joined["dp"], joined["grad_accum"]) == (2, 2, 1)
    assert (f"brigade: node 1 joined at step {joined['at_step']} — continuing on 2 nodes as dp 2 × pp 1 "
            f"with gradient accumulation 1 (global batch 16 unchanged) from snapshot step "
            f"{joined['step']}") in said
    _same_losses(out, reference)


def test_fewer_processes_than_stages_waits_then_stops(tmp_path):
    """--pp 2 with one process per node: one node alone cannot hold the pipeline. After node 1 is
    lost, node 0 waits for a second node up to --rdzv-timeout, then stops with one line."""
    out = tmp_path / "waits"
    nodes = Nodes(out)
    nodes.flags = [*nodes.flags, "--pp", "2", "--microbatches", "2", "--rdzv-timeout", "20"]
    try:
        nodes.start(0)
        nodes.start(1)
        _wait_for(out, lambda rows: len([r for r in rows if "loss" in r]) >= 12)
        killed = nodes.kill(1)
        said, err = nodes.wait(0, timeout=300)
        waited = time.time() - killed
    finally:
        nodes.close()
    assert nodes.procs[0].returncode == 1, said[-2000:] + err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("brigade train: error:")]
    assert len(lines) == 1 and "fewer than 2 nodes met at the rendezvous" in lines[0], err[-2000:]
    assert "within --rdzv-timeout 20 s" in lines[0] and "Traceback" not in err
    assert 20 <= waited < 120, waited
