"""Running brigade as a user does: a process of its own, its output, its exit code."""

import contextlib
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.e2e.zygote import Zygote

# --no-mfu: a process's first count of FLOPs on the meta device imports some 800 modules of torch's
# (about 1.3 s); tests/train/test_mfu.py and test_outputs_of_a_run count them
TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--context", "32", "--block-size", "32",
        "--batch-size", "8", "--eval-every", "10", "--eval-batches", "2", "--sample-tokens", "20",
        "--warmup-steps", "5", "--no-mfu"]


_ZYGOTE = Zygote()


def brigade(*args, timeout=240, env=None, cwd=None):
    """`python -m brigade ARGS` as a finished process (returncode, stdout, stderr). Forked from the
    worker's zygote (tests/e2e/zygote.py: brigade imported once, not once a command) unless the
    call names its own environment, which then reaches a fresh interpreter's imports too."""
    argv = [*map(str, args)]
    if env is None:
        with tempfile.TemporaryDirectory(prefix="brigade-cmd-") as scratch:
            return _ZYGOTE.run(argv, cwd, timeout, Path(scratch))
    return subprocess.run([sys.executable, "-m", "brigade", *argv], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=cwd)


def train(out, *args, timeout=240, env=None):
    return brigade("train", "--out", out, *TINY, *args, timeout=timeout, env=env)


def inspect(out) -> dict:
    """`brigade inspect OUT --json`, in this process: reading a result needs no process start
    (`brigade inspect` itself runs as a user runs it in test_readme and test_bad_input)."""
    from brigade.cli import main

    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        code = main(["inspect", str(out), "--json"])
    assert code == 0, errors.getvalue()
    return json.loads(printed.getvalue())


def final_hash(out) -> str:
    return inspect(out)["params_sha256"]


def losses(out) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}
