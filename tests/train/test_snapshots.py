"""When a run snapshots, and what a stop signal or a failed write does to one in flight.

One launch of 2 gloo processes runs `train.run._train` (what `brigade train`'s workers run) six
times on a tiny GPT, each with its writes slowed or failed by the `during_write` hook
(`FaultInjector.during_snapshot`, patched) and SIGTERM stood in for as the exact-resume test
does (`agent.stop_requested` turns true after step 3):

- stopped while snapshot 2 is being written, within half of --stop-grace: it is finished,
  step 3's is written, and the run says so;
- stopped while snapshot 2 is held past half the grace: it is abandoned (never complete),
  step 3's is not written, and the newest complete snapshot is step 1's;
- stopped while rank 0 still commits snapshot 2 and rank 1's part of it has long ended (rank 0
  holds a snapshot in flight until its commit ends, the others until DCP does): every rank
  takes the same path, the commit is waited for and step 3's is written (the exact-resume
  worlds of the slow tier once hung here, rank 0 waiting in one collective and the rest in
  another);
- --snapshot-minutes tiny, --snapshot-every 0: a snapshot after every step, by time;
- a write failing on rank 1 under --on-snapshot-error warn: said, and training goes on to
  its end and its last snapshot; under stop: the run ends there, on every rank;
- a NaN loss at step 4 while rank 0 still commits snapshot 2 (rank 1 let go of it at step 3):
  every rank names snapshot 2 as the newest good one (rank 1 once named none: a CI failure).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)
RUN = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--context", "16", "--block-size", "16",
       "--batch-size", "8", "--max-steps", "6", "--eval-every", "100", "--eval-batches", "1",
       "--sample-tokens", "0", "--nproc", "2"]
# name: (flags, {step: what the write of that step's snapshot does}, stop after step)
CASES = {
    "finished": (["--snapshot-every", "1", "--stop-grace", "60"], {2: ("sleep", 1.0)}, 3),
    "abandoned": (["--snapshot-every", "1", "--stop-grace", "2"], {2: ("sleep", 6.0)}, 3),
    "commit-late": (["--snapshot-every", "2", "--stop-grace", "60"], {"commit": 1.5}, 3),
    "by-time": (["--snapshot-every", "0", "--snapshot-minutes", "0.00001"], {}, None),
    "warn": (["--snapshot-every", "2", "--on-snapshot-error", "warn"], {2: ("fail", 1)}, None),
    "stop": (["--snapshot-every", "2"], {2: ("fail", 1)}, None),
    "nan-commit-late": (["--snapshot-every", "2"], {"commit": 1.5, "nan": "nan:rank=1:step=4"}, None),
}


def _config(out: Path, flags: list[str]):
    from brigade import config
    from brigade.cli import build_parser

    return config.build(build_parser().parse_args(["train", "--out", str(out), *RUN, *flags]))


def _runs(root: str) -> dict:
    """Worker: each case's `_train`, with its hook and stop; {case: summary or the error's line}."""
    import torch.distributed as dist

    from brigade import forensics
    from brigade.launcher import agent, groups
    from brigade.train import faults
    from brigade.train import run as train_run

    info = groups.init("gloo", None, forensics.group_timeout(60))
    got: dict = {}
    asked, during = agent.stop_requested, faults.FaultInjector.during_snapshot
    try:
        for name, (flags, writes, stop_after) in CASES.items():
            faults.FaultInjector.during_snapshot = _hook(writes)
            _commit_late(writes.get("commit"))
            if stop_after:
                count = [0]
                agent.stop_requested = lambda c=count, n=stop_after: (c.__setitem__(0, c[0] + 1) or c[0] >= n)
            try:
                fault = faults.parse_fault(writes["nan"]) if "nan" in writes else None
                got[name] = train_run._train(_config(Path(root) / name, flags), info, fault)
            except Exception as exc:  # the case that stops on a failed snapshot
                got[name] = f"{type(exc).__name__}: {exc}"
            finally:
                agent.stop_requested = asked
            _join_abandoned_writes()
            dist.barrier()
    finally:
        faults.FaultInjector.during_snapshot = during
        _commit_late(None)
        groups.destroy()
    return got


def _join_abandoned_writes() -> None:
    """Wait for the writes a case left behind. An abandoned snapshot's DCP thread goes on writing
    after its run has left, on the writer's gloo group, which every run of this world shares: a
    real run's process exits there, but here the next case's snapshots would call collectives on
    that group beside it, and ranks that paired them in another order would hang."""
    import threading

    for thread in threading.enumerate():
        if thread.name.startswith("snapshot-"):  # writer.Writing.finish, one a background snapshot
            thread.join(60)


_ORIGINAL: dict = {}


def _commit_late(seconds: float | None) -> None:
    """Rank 0's commit held `seconds` (None: as it is), and every other rank's part of a snapshot
    taken as ended by the next step's end: the order of a slow commit, made certain."""
    import torch.distributed as dist

    from brigade.snapshot import commit, writer

    run = _ORIGINAL.setdefault("run", commit.Commit.run)
    settle = _ORIGINAL.setdefault("settle", writer.Writer.settle)
    commit.Commit.run, writer.Writer.settle = run, settle
    if seconds is None:
        return
    commit.Commit.run = lambda self: (time.sleep(seconds), run(self))[1]
    writer.Writer.settle = lambda self, timeout=None: settle(self, None if dist.get_rank() else timeout)


def _hook(writes: dict):
    def during_snapshot(self, step: int) -> None:
        import torch.distributed as dist

        what = writes.get(step)
        if what and what[0] == "sleep":
            time.sleep(what[1])
        if what and what[0] == "fail" and dist.get_rank() == what[1]:
            raise OSError(28, "No space left on device")
    return during_snapshot


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from brigade.launcher import agent

    root = tmp_path_factory.mktemp("snapshots")
    return root, agent.launch(_runs, 2, str(root))


def _events(out: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("event") == kind]


def _complete(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "snapshots").iterdir() if p.name.startswith("step_"))


def test_a_snapshot_in_flight_at_a_stop_is_finished_within_half_the_grace(runs):
    root, got = runs
    out = root / "finished"
    assert got[0]["finished"]["preempted"] and got[0]["finished"]["step"] == 3
    [stop] = _events(out, "stop")
    assert (stop["outcome"], stop["in_flight"]) == ("finished", 2)
    assert _complete(out) == ["step_00000002", "step_00000003"]
    assert got[0]["finished"]["snapshot"].endswith("step_00000003")


def test_a_snapshot_in_flight_past_half_the_grace_is_abandoned(runs):
    root, got = runs
    out = root / "abandoned"
    [stop] = _events(out, "stop")
    assert (stop["outcome"], stop["in_flight"]) == ("abandoned", 2)
    assert stop["waited_s"] < 2.5  # half of --stop-grace 2, not the 6 s the write was held
    assert _complete(out) == ["step_00000001"]  # neither step 2's nor step 3's
    assert got[0]["abandoned"]["snapshot"].endswith("step_00000001")


def test_a_stop_while_rank_0_still_commits_takes_one_path_on_every_rank(runs):
    root, got = runs
    out = root / "commit-late"
    assert all(got[rank]["commit-late"]["preempted"] for rank in (0, 1)), got
    [stop] = _events(out, "stop")
    assert (stop["outcome"], stop["in_flight"]) == ("finished", 2)
    assert _complete(out) == ["step_00000002", "step_00000003"]


def test_snapshots_by_wall_time(runs):
    root, _ = runs
    steps = [e["step"] for e in _events(root / "by-time", "snapshot")]
    assert steps == [1, 2, 3, 4, 5, 6]  # every step's, by time; the last one as every run's last
    assert [e["async"] for e in _events(root / "by-time", "snapshot")] == [True] * 5 + [False]


def test_a_failed_write_under_warn_trains_on(runs):
    root, got = runs
    out = root / "warn"
    [failed] = _events(out, "snapshot_failed")
    assert failed["snapshot_step"] == 2 and "No space left on device" in failed["error"]
    assert got[0]["warn"]["step"] == 6 and _complete(out) == ["step_00000004", "step_00000006"]


def test_a_failed_write_under_stop_ends_the_run_on_every_rank(runs):
    root, got = runs
    for rank in (0, 1):
        line = got[rank]["stop"]
        assert line.startswith("SnapshotError: writing snapshot step 2 in "), line
        assert "no snapshot is complete yet" in line
    assert "No space left on device" in got[0]["stop"]
    assert not (root / "stop" / "snapshots" / "step_00000002").exists()


def test_a_nan_loss_while_rank_0_still_commits_names_that_snapshot_on_every_rank(runs):
    root, got = runs
    out = root / "nan-commit-late"
    for rank in (0, 1):
        line = got[rank]["nan-commit-late"]
        assert line.startswith("RunError: the loss is nan at step 4; the newest good snapshot is "
                               f"step 2 in {out / 'snapshots'}: lower --lr"), line
