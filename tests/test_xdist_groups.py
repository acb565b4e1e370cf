"""An `xdist_group` runs on one worker: the spawned worlds the suite shares depend on it."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
CASES = '''
import os

import pytest


@pytest.mark.parametrize("i", [pytest.param(i, marks=pytest.mark.xdist_group("g")) for i in range(6)])
def test_grouped(i):
    with open(os.path.join(os.environ["WORKERS_SEEN"], os.environ["PYTEST_XDIST_WORKER"]), "a") as f:
        f.write(f"{i}\\n")
'''


def test_a_group_lands_on_one_worker(tmp_path):
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.xdist_groups"]\n')
    seen = tmp_path / "seen"
    seen.mkdir()
    result = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q",
                             "-p", "no:cacheprovider", "-o", "addopts=", str(tmp_path / "test_cases.py")],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "WORKERS_SEEN": str(seen)})
    assert result.returncode == 0, result.stdout[-2000:]
    runs = {p.name: p.read_text().split() for p in seen.iterdir()}
    assert len(runs) == 1 and len(next(iter(runs.values()))) == 6, runs
