"""The suite's watchdog (tests/watchdog.py): a test that blocks in C with the GIL held ends
within its bound and prints every thread's stack, where pytest-timeout alone never fires."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]

BLOCKED = '''
import ctypes
import threading

import pytest


@pytest.mark.timeout(1)
def test_blocks_in_c_with_the_gil_held():
    threading.Thread(target=threading.Event().wait, name="a-waiting-helper", daemon=True).start()
    libc = ctypes.PyDLL(None)  # calls keep the GIL, as a pybind destructor does
    mutex = ctypes.create_string_buffer(64)  # a default pthread mutex (all zeros), locked twice:
    libc.pthread_mutex_lock(mutex)  # blocks for ever, and no signal ends the wait (as in the
    libc.pthread_mutex_lock(mutex)  # suite's hang: std::thread::join inside a gloo destructor)
'''


def _pytest(tmp_path: Path, *plugins: str) -> subprocess.Popen:
    (tmp_path / "test_blocked.py").write_text(BLOCKED)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
           "--rootdir", str(tmp_path), "-c", "/dev/null", *plugins, str(tmp_path / "test_blocked.py")]
    env = {"PYTHONPATH": str(ROOT), "BRIGADE_WATCHDOG_MARGIN_S": "2", "PATH": "/usr/bin:/bin"}
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


@pytest.mark.timeout(120)
def test_pytest_timeout_alone_cannot_end_a_test_blocked_in_c(tmp_path):
    """Why the watchdog exists: its 1 s limit long past, the test is still running."""
    proc = _pytest(tmp_path)
    time.sleep(8)
    try:
        assert proc.poll() is None, proc.communicate()[0]
    finally:
        proc.kill()
        proc.communicate()


@pytest.mark.timeout(120)
def test_the_watchdog_ends_it_within_its_bound_with_every_threads_stack(tmp_path):
    start = time.monotonic()
    proc = _pytest(tmp_path, "-p", "tests.watchdog")
    output, _ = proc.communicate(timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0 and elapsed < 30, (elapsed, output)
    assert "Timeout (0:00:03)!" in output, output  # the test's 1 s + the 2 s margin
    assert "in test_blocks_in_c_with_the_gil_held" in output  # the stuck main thread's frame
    assert output.count("Thread 0x") >= 2 and "in wait" in output  # and the other thread's


@pytest.mark.timeout(120)
def test_a_process_forked_under_the_armed_watchdog_can_arm_its_own(tmp_path):
    """A child forked while the watchdog is armed inherits its lock held by a thread it lacks;
    brigade's workers (forked by the elastic agent) arm their own around teardown, which then
    waited for ever: the watchdog stops across a fork and the parent re-arms it."""
    (tmp_path / "test_fork.py").write_text(
        "import faulthandler, os\n\n\n"
        "def test_fork():\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        faulthandler.dump_traceback_later(30, exit=True)\n"
        "        faulthandler.cancel_dump_traceback_later()\n"
        "        os._exit(0)\n"
        "    assert os.waitpid(pid, 0)[1] == 0\n")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--rootdir",
           str(tmp_path), "-c", "/dev/null", "-p", "tests.watchdog", str(tmp_path / "test_fork.py")]
    result = subprocess.run(cmd, cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
