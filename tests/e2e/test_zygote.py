"""tests/e2e/zygote.py: a command forked from the zygote ends as `python -m brigade` ends in a
process of its own (exit code, both streams, working directory, the caller's environment at the
call), and one that runs past its timeout is killed without leaving the next command a stale
answer."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.zygote import Zygote


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    if z.proc is not None:
        z.proc.stdin.close()
        z.proc.wait(timeout=60)


def _both(zygote, tmp_path, argv, cwd):
    forked = zygote.run(argv, str(cwd), 120, tmp_path)
    plain = subprocess.run([sys.executable, "-m", "brigade", *argv], capture_output=True, text=True,
                           cwd=cwd, timeout=120)
    return forked, plain


@pytest.mark.parametrize("argv", [["inspect", "nowhere"], ["nosuch"], ["--help"]],
                         ids=["refused", "unknown-command", "help"])
def test_a_forked_command_ends_as_a_fresh_interpreter_ends(zygote, tmp_path, argv, monkeypatch):
    monkeypatch.setenv("COLUMNS", "50")  # argparse wraps --help to it: the call's environment counts
    forked, plain = _both(zygote, tmp_path, argv, tmp_path)
    assert (forked.returncode, forked.stdout, forked.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    assert forked.returncode == (0 if argv == ["--help"] else 2)


def test_the_working_directory_is_the_callers(zygote, tmp_path):
    (tmp_path / "here").mkdir()
    got = zygote.run(["inspect", "here"], str(tmp_path), 120, tmp_path)
    assert got.returncode == 2 and "here holds no complete snapshot" in got.stderr, got.stderr


def test_a_command_past_its_timeout_is_killed_and_the_next_one_answers(zygote, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run(["train", "--out", str(tmp_path / "run"), "--max-steps", "100000"], None, 3, tmp_path)
    assert zygote.proc is None  # the zygote went with the command it would answer for later
    again = zygote.run(["inspect", "nowhere"], str(tmp_path), 120, tmp_path)
    assert again.returncode == 2 and "not found" in again.stderr
