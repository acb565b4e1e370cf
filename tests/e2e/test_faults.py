"""Kill any process at any moment: the run finishes as if nothing had happened, bit for bit.

Results are read in this process (`inspect`, `final_hash`: no process start); a case refused
before any worker starts runs `brigade` in this process too (the `cli` fixture, tests/conftest.py).
"""

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import TINY, final_hash, inspect, losses, train

pytestmark = pytest.mark.timeout(300)
RUN = ["--max-steps", "12", "--snapshot-every", "5", "--dropout", "0.1", "--sample-tokens", "0"]


# A session fixture is made once per pytest-xdist worker: the tests that compare with `reference`
# run on one worker (one group), so it is trained once, not once on each worker.
WITH_REFERENCE = pytest.mark.xdist_group("faults-reference")


@pytest.fixture(scope="session")  # not module: xdist interleaves modules, which tears it down
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    result = train(out, *RUN)
    assert result.returncode == 0, result.stderr
    return out


@WITH_REFERENCE
def test_kill_at_a_step(reference, tmp_path):
    out = tmp_path / "killed"
    result = train(out, *RUN, "--inject-fault", "kill:rank=1:step=7", "--max-restarts", "1")
    assert result.returncode == 0, result.stderr
    # Under load the agent may also see rank 0 fail (its peer vanished) in the same check.
    line = next(ln for ln in result.stdout.splitlines() if "restarting" in ln)
    assert "rank 1 died (SIGKILL)" in line
    assert line.endswith("at step 7 — restarting 1/1 from snapshot step 5")
    assert "Traceback" not in result.stdout + result.stderr
    assert (out / "logs" / "agent.log").is_file()
    assert final_hash(out) == final_hash(reference)
    assert losses(out) == losses(reference)


@WITH_REFERENCE
def test_stall_is_caught_by_the_hang_timeout_and_restarted(reference, tmp_path):
    out = tmp_path / "stalled"
    start = time.time()
    result = train(out, *RUN, "--inject-fault", "stall:rank=1:step=7", "--max-restarts", "1",
                   "--hang-timeout", "5")
    assert result.returncode == 0, result.stderr
    assert "brigade: the run hung (report above) at step 7 — restarting 1/1 from snapshot step 5" \
        in result.stdout
    assert final_hash(out) == final_hash(reference)
    assert time.time() - start < 120


def test_hang_report_names_the_stalled_rank(tmp_path):
    out = tmp_path / "hung"
    result = train(out, *RUN, "--pp", "2", "--inject-fault", "stall:rank=1:step=5", "--hang-timeout", "5")
    assert result.returncode == 1
    table = result.stdout[result.stdout.index("brigade: hang"):]
    seconds = float(re.search(r"no progress for (\d+) s \(--hang-timeout 5\)", table)[1])
    assert seconds <= 5 + 2  # reported within the timeout (plus the watchdog's poll)
    rows = {int(line.split()[0]): line for line in table.splitlines()[2:4]}
    assert rows[1].endswith("<- stuck") and "step 5 begins" in rows[1]
    assert rows[0].endswith("waiting") and "from stage 1 (rank 1)" in rows[0]
    assert "verdict: rank 1 made no progress outside any transfer or collective" in table
    assert "--- rank 1 stack <- stuck" in table and "in before_step" in table  # faulthandler's stack
    assert "the run hung: rank 1 made no progress" in result.stderr.splitlines()[-1]
    report = (out / "logs" / "hang-report.txt").read_text()
    assert "=== rank 0" in report and "=== rank 1" in report


@WITH_REFERENCE
@pytest.mark.parametrize("rank", [0, 1])
def test_kill_during_a_background_snapshot_write(reference, tmp_path, rank):
    """Snapshot 10 is written in the background (the default) while step 11 runs; rank 0 (which
    would commit it) or rank 1 dies as it starts writing its part. It is never marked complete:
    the restart resumes from the previous complete one, 5, and the run ends bit for bit."""
    out = tmp_path / "mid-snapshot"
    result = train(out, *RUN, "--inject-fault", f"kill-during-snapshot:rank={rank}:step=10",
                   "--max-restarts", "1")
    assert result.returncode == 0, result.stderr
    assert f"rank {rank} died (SIGKILL)" in result.stdout
    assert "restarting 1/1 from snapshot step 5" in result.stdout  # 10 never committed
    assert "snapshot_async = true" in (out / "config.toml").read_text()  # the default
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    firsts = [(r["attempt"], r["resumed_from"]) for r in rows if r.get("event") == "first_step"]
    assert firsts == [(0, 0), (1, 5)]
    assert final_hash(out) == final_hash(reference)
    assert losses(out) == losses(reference)


@WITH_REFERENCE
def test_corrupt_newest_snapshot_falls_back(reference, tmp_path):
    """The finished reference run with its newest snapshot damaged (a run that died with no
    restarts left is test_resume_under_another_layout's): resumed, it falls back to the older one
    and trains to the same parameters."""
    out = tmp_path / "corrupt"
    shutil.copytree(reference, out)
    newest = out / "snapshots" / "step_00000012"
    data = next(newest.glob("*.distcp"))
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))
    result = train(out, *RUN)
    assert result.returncode == 0, result.stderr
    assert "skipping snapshot step_00000012" in result.stdout and "does not match its checksum" in \
        result.stdout
    assert "resuming from snapshot step 10" in result.stdout
    assert max(losses(out)) == 12
    assert final_hash(out) == final_hash(reference)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _steps_of_attempt(out: Path, attempt: int) -> list[int]:
    """The steps logged since attempt `attempt` began (its first_step event; 0: from the start)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    begun = next((i for i, r in enumerate(rows)
                  if r.get("event") == "first_step" and r["attempt"] == attempt), None)
    return [] if begun is None else [r["step"] for r in rows[begun:] if "loss" in r]


def _wait_for_step(out: Path, step: int, proc, limit: float = 120, attempt: int = 0) -> None:
    """Until attempt `attempt` has logged `step`: lines an earlier attempt left count for nothing
    (a group killed at step 45 may have logged past 60 before the kill landed, on a loaded machine)."""
    end = time.time() + limit
    while time.time() < end and proc.poll() is None:
        try:
            if (out / "metrics.jsonl").is_file() and max(_steps_of_attempt(out, attempt), default=0) >= step:
                return
        except ValueError:  # a line being written
            pass
        time.sleep(0.05)
    raise AssertionError(f"run never reached step {step} in attempt {attempt}")


LONG = ["--max-steps", "150", "--snapshot-every", "20", "--dropout", "0.1", "--sample-tokens", "0",
        "--eval-every", "50"]


@pytest.fixture(scope="session")  # not module: xdist interleaves modules, which tears it down
def long_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("long")
    assert train(out, *LONG).returncode == 0
    return out


def _start(out, *extra):
    cmd = [sys.executable, "-m", "brigade", "train", "--out", str(out), *TINY, *LONG, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _sigterm(out: Path, proc, step: int, attempt: int = 0) -> tuple[str, int]:
    """SIGTERM once the run (its attempt `attempt`) reaches `step`: exit 0 well within a scheduler's
    grace, the step in flight finished and kept in a complete snapshot. Returns stdout and the
    snapshot's step."""
    _wait_for_step(out, step, proc, limit=180, attempt=attempt)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, stderr
    assert elapsed < 15, f"{elapsed:.1f} s from SIGTERM to exit"
    assert "forcefully exiting" not in (out / "logs" / "agent.log").read_text()
    kept = max(losses(out))
    assert kept >= step
    assert f"stopped by SIGTERM; newest snapshot: step {kept}." in stdout
    inspected = inspect(out)
    assert inspected["step"] == kept and inspected["checksums"] == "ok"
    return stdout, kept


# One run takes two faults from outside, then is resumed to the end, bit for bit: a worker
# SIGKILLed by someone else (the agent restarts the group from the snapshot at step 40), then the
# whole run SIGTERMed (the dp2 case of the grace test below).
@pytest.mark.full
def test_sigkill_from_outside_then_sigterm_then_resume(long_reference, tmp_path):
    out = tmp_path / "outside"
    proc = _start(out, "--max-restarts", "1")
    _wait_for_step(out, 45, proc)
    workers = [p for p in _children(proc.pid)  # forked workers, not multiprocessing's helpers
               if "resource_tracker" not in Path(f"/proc/{p}/cmdline").read_text()]
    assert len(workers) == 2
    os.kill(workers[-1], signal.SIGKILL)
    stdout, step = _sigterm(out, proc, 60, attempt=1)  # the restarted group, past step 45
    assert "died (SIGKILL)" in stdout and "restarting 1/1 from snapshot step 40" in stdout
    assert 60 <= step < 150  # the step in flight finished and was kept
    resumed = train(out, *LONG)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from snapshot step {step}" in resumed.stdout
    assert max(losses(out)) == 150
    assert final_hash(out) == final_hash(long_reference)


# A scheduler sends SIGTERM and kills 30 s later (Slurm's KillWait, Kubernetes' grace period).
# dp2 is test_sigkill_from_outside_then_sigterm_then_resume, which resumes to the end.
@pytest.mark.parametrize("layout", [["--pp", "2"], ["--nproc", "4", "--pp", "2"], ["--local-stages", "2"]],
                         ids=["pp2", "dp2xpp2", "dp2xlocal2"])
def test_sigterm_exits_well_within_a_schedulers_grace(tmp_path, layout):
    out = tmp_path / "preempted"
    _, step = _sigterm(out, _start(out, *layout), 3)
    # two steps more, not to the end: the decay's end kept where the 150-step run put it
    resumed = train(out, *LONG[2:], "--max-steps", str(step + 2), "--decay-steps", "150", *layout)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from snapshot step {step}" in resumed.stdout
    assert max(losses(out)) == step + 2


def _all_finite(snapshot: Path, tmp: Path) -> bool:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(snapshot, tmp / "flat.pt")
    state = torch.load(tmp / "flat.pt", weights_only=False)
    tensors = []

    def walk(value):
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)

    walk(state)
    floats = [t for t in tensors if t.is_floating_point()]
    return bool(floats) and all(bool(torch.isfinite(t).all()) for t in floats)


@pytest.mark.parametrize("layout,rank", [([], 1), (["--pp", "2"], 0)], ids=["dp2-rank1", "pp2-first-stage"])
def test_a_nan_loss_stops_the_run_at_that_step(tmp_path, layout, rank):
    out = tmp_path / "nan"
    result = train(out, *RUN, *layout, "--inject-fault", f"nan:rank={rank}:step=10")
    assert result.returncode == 1, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stdout + result.stderr, result.stderr
    assert f"the loss is nan at step 10; the newest good snapshot is step 5 in {out / 'snapshots'}: " \
        "lower --lr" in lines[0]
    assert max(losses(out)) == 9  # step 10 was never taken, nor logged
    snaps = out / "snapshots"
    assert sorted(p.name for p in snaps.iterdir()) == ["LATEST", "step_00000005"]
    inspected = inspect(out)
    assert inspected["step"] == 5 and inspected["checksums"] == "ok"
    assert _all_finite(snaps / "step_00000005", tmp_path)


def test_rng_streams_after_resume_equal_uninterrupted(tmp_path):
    from brigade.cli import build_parser
    from brigade.config import build
    from brigade.train.faults import parse_fault
    from brigade.train.run import run

    def go(out, fault=None):
        args = build_parser().parse_args(["train", "--out", str(out), *TINY, *RUN,
                                          "--max-restarts", "1"])
        return run(build(args), parse_fault(fault) if fault else None)

    plain = go(tmp_path / "plain")
    resumed = go(tmp_path / "resumed", "kill:rank=0:step=8")
    assert sorted(plain) == sorted(resumed) == [0, 1]
    for rank in plain:
        assert resumed[rank]["rng"] == plain[rank]["rng"], f"rank {rank}"
    assert plain[0]["rng"] != plain[1]["rng"]  # each rank has a stream of its own


@pytest.mark.full
def test_resume_under_another_layout(tmp_path):
    base = ["--max-steps", "12", "--snapshot-every", "3", "--sample-tokens", "0"]
    whole = tmp_path / "whole"
    assert train(whole, *base, "--pp", "2").returncode == 0
    out = tmp_path / "moved"
    dead = train(out, *base, "--pp", "2", "--inject-fault", "kill:rank=1:step=8")  # no restarts: it fails
    assert dead.returncode == 1 and "died (SIGKILL)" in dead.stderr + dead.stdout
    assert inspect(out)["layout"]["pp"] == 2
    result = train(out, *base, "--pp", "1")  # now dp = 2
    assert result.returncode == 0, result.stderr
    assert "resuming from snapshot step 6" in result.stdout
    got, want = losses(out), losses(whole)
    assert sorted(got) == list(range(1, 13))
    for step in range(7, 13):
        assert got[step] == pytest.approx(want[step], abs=1e-5)
    assert inspect(out)["layout"] == {"dp": 2, "pp": 1, "local_stages": 1, "virtual": 1, "tp": 1, "cp": 1}


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


@WITH_REFERENCE
def test_a_pickle_with_code_is_never_executed(reference, cli, tmp_path, monkeypatch):
    out = tmp_path / "evil"
    shutil.copytree(reference, out)
    snap = out / "snapshots" / "step_00000012"
    (snap / ".metadata").write_bytes(pickle.dumps(_Evil()))
    manifest = json.loads((snap / "manifest.json").read_text())
    from brigade.snapshot.format import sha256_file

    manifest["files"][".metadata"] = sha256_file(snap / ".metadata")  # a consistent forgery
    (snap / "manifest.json").write_text(json.dumps(manifest))
    with monkeypatch.context() as here:
        here.chdir(tmp_path)  # where os.system would touch PWNED
        gen = cli("generate", "--from", out, "--tokens", "5")
    assert gen.returncode == 2 and "refusing to load it" in gen.stderr
    resume = train(out, *RUN)
    assert resume.returncode != 0 and "refusing to load it" in resume.stderr
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()


@WITH_REFERENCE
def test_refuses_a_snapshot_of_another_model(reference, cli, tmp_path):
    out = tmp_path / "other"
    shutil.copytree(reference, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    result = cli("train", "--out", out, *TINY, *RUN, "--n-embd", "64")
    assert result.returncode == 2
    assert "is of another model (differs in model.n_embd)" in result.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing touched
