"""Every collective and transfer tensor is placed on its process's device (NCCL's rule, checked on CPU).

Each command runs with tests/device_audit.py installed in all its processes: a tensor created
without `device=` that reaches torch.distributed fails the command.
"""

import os
import sys
from pathlib import Path

import pytest

from tests.e2e.helpers import TINY

REPO = Path(__file__).resolve().parents[1]
SMALL_SWEEP = ["--model", "toy", "--batch-size", "8", "--splits", "4", "--repeats", "1",
               "--schedules", "1f1b"]

COMMANDS = {
    "train pp2 + snapshots": ["train", "--nproc", "2", "--pp", "2", *TINY, "--max-steps", "3",
                              "--snapshot-every", "2", "--sample-tokens", "0"],
    "train dp2": ["train", "--nproc", "2", *TINY, "--max-steps", "2", "--sample-tokens", "0"],
    "check": ["check", "--model", "toy", "--stages", "2", "--microbatches", "2", "--batch-size", "4"],
    "doctor": ["doctor", "--nproc", "2"],
    "bench": ["bench", *SMALL_SWEEP],
    "tune": ["tune", *SMALL_SWEEP],
}


@pytest.fixture
def audited_env(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        f"import sys\nsys.path.insert(0, {str(REPO)!r})\n"
        "from tests.device_audit import install\ninstall()\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", COMMANDS)
def test_collective_tensors_are_placed(name, audited_env, tmp_path):
    import subprocess

    args = COMMANDS[name]
    if args[0] in ("train", "bench", "tune", "doctor"):
        args = [*args, "--out", str(tmp_path / "out")]
    r = subprocess.run([sys.executable, "-m", "brigade", *args, "--debug"], env=audited_env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=280)
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "out").rglob("*.log")) \
        if (tmp_path / "out").is_dir() else ""
    assert "NoDeviceChosen" not in r.stdout + r.stderr + logs, (r.stdout + r.stderr + logs)[-4000:]
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]


def test_the_audit_catches_an_unplaced_tensor(audited_env, tmp_path):
    import subprocess

    code = ("import torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
            "dist.all_reduce(torch.ones(3, device='cpu'))\n"
            "dist.all_reduce(torch.tensor([1.0]).to('cpu') * 2)\n"
            "dist.all_reduce(torch.tensor([1.0]))\n")
    r = subprocess.run([sys.executable, "-c", code], env=audited_env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "NoDeviceChosen" in r.stderr, r.stderr[-2000:]
    assert r.stderr.count("NoDeviceChosen") >= 1 and "line 5" in r.stderr, r.stderr[-2000:]
