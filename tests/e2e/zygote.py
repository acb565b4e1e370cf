"""A started interpreter that has imported brigade once and forks a process per `brigade` command.

A test's `brigade train ...` spends about 2.5 s of CPU importing torch, DTensor and brigade before
the command starts; the suite runs some hundreds, on two cores. Here one process per pytest
worker imports them once (`PRELOAD`, no tensor math, so no thread pool is started before a fork)
and, for each command, forks a child that is that command: its own process, working directory,
environment (the caller's at the time of the call), standard streams (files the caller reads),
exit code, `brigade.cli.main` with the command's words, as `python -m brigade` runs it. The agent
in that child forks its workers as it does under a plain `python -m brigade`.

What differs from a fresh interpreter is only what an import did with the environment of the
moment the zygote started: `helpers.brigade` keeps a plain subprocess for a call that names its
own environment, and the README's commands (tests/e2e/test_readme.py) always run as typed.

Protocol, one JSON line each way: {"argv", "cwd", "env", "out", "err"} → {"pid"}, then
{"code"} once the child has exited. A caller that stops waiting (its own timeout, pytest-timeout's)
kills the child and the zygote; the next command starts another.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import traceback
from pathlib import Path

# what `python -m brigade train` imports before it trains (python -X importtime): torch and
# DTensor, the check and train commands, the launcher; and torch._dynamo, which the agent imports
# before it forks its workers (`launcher.agent._ready_to_fork`). Importing it sets
# TORCHINDUCTOR_CACHE_DIR to torch's default folder; a child takes the caller's environment
# instead, where the default folder is what torch takes when the variable is unset.
PRELOAD = ("brigade.cli", "brigade.train.run", "brigade.train.evaluate", "brigade.check.run",
           "brigade.launcher.agent", "torch._dynamo")


def _child(request: dict) -> None:
    """In the forked child: become the command, then exit as the interpreter would."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["out"], os.O_WRONLY),
                               (2, request["err"], os.O_WRONLY)):
            opened = os.open(path, mode)
            os.dup2(opened, fd)
            os.close(opened)
        code = _run(request["argv"])
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _run(argv: list[str]) -> int:
    """`sys.exit(main())` of brigade/__main__.py, with the exit code Python would give."""
    from brigade import cli

    sys.argv = [str(Path(cli.__file__).with_name("__main__.py")), *argv]
    try:
        got = cli.main(argv)
    except SystemExit as exc:
        got = exc.code
    except BaseException:  # noqa: BLE001  (an uncaught error: its traceback, exit 1)
        traceback.print_exc()
        return 1
    if got is None:
        return 0
    if isinstance(got, int):
        return got
    print(got, file=sys.stderr)
    return 1


def serve() -> None:
    """The zygote's loop: import once, then a forked child per request line on stdin."""
    import gc
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()
    channel_in, channel_out = sys.stdin.buffer, sys.stdout.buffer
    for line in channel_in:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        channel_out.write(json.dumps({"pid": pid}).encode() + b"\n")
        channel_out.flush()
        _, status = os.waitpid(pid, 0)
        channel_out.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        channel_out.flush()


class Zygote:
    """The caller's side: one zygote process, started on first use, reused by later commands."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def _started(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            root = str(Path(__file__).resolve().parents[2])
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.zygote"], cwd=root,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        return self.proc

    def _reply(self, timeout: float | None) -> dict | None:
        """The zygote's next line, or None past `timeout` s (unbuffered: a buffer could hold the
        second reply already while select waits on the pipe for it)."""
        out = self.proc.stdout
        ready, _, _ = select.select([out], [], [], timeout)
        if not ready:
            return None
        line = out.readline()
        if not line:
            raise RuntimeError("the test zygote exited")
        return json.loads(line)

    def run(self, argv: list[str], cwd: str | None, timeout: float,
            scratch: Path) -> subprocess.CompletedProcess:
        """`subprocess.run([python, -m, brigade, *argv], capture_output=True, text=True)`, forked."""
        proc = self._started()
        out, err = scratch / "stdout", scratch / "stderr"
        out.write_bytes(b"")
        err.write_bytes(b"")
        request = {"argv": argv, "cwd": os.path.abspath(cwd or os.getcwd()), "env": dict(os.environ),
                   "out": str(out), "err": str(err)}
        line = memoryview(json.dumps(request).encode() + b"\n")
        while line:  # unbuffered: a write to a pipe may take part of a long line
            line = line[proc.stdin.write(line):]
        pid = self._reply(300)["pid"]  # the first command waits for the zygote's imports
        try:
            done = self._reply(timeout)
        except BaseException:  # pytest-timeout's, an interrupt: leave no command half-answered
            self._abandon(pid)
            raise
        words = [sys.executable, "-m", "brigade", *argv]
        if done is None:
            self._abandon(pid)
            raise subprocess.TimeoutExpired(words, timeout, out.read_text(errors="replace"),
                                            err.read_text(errors="replace"))
        return subprocess.CompletedProcess(words, done["code"], out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))

    def _abandon(self, pid: int) -> None:
        """Kill a command that is not to be waited for, and the zygote that would answer for it
        later (the next command starts a new one)."""
        for target in (pid, self.proc.pid):
            try:
                os.kill(target, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.proc = None


if __name__ == "__main__":
    serve()
