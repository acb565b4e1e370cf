"""Shared fixtures: `brigade` in this process for cases that start no worker, and one tiny trained run.

A `python -m brigade ...` subprocess costs seconds of torch import; a case refused before any
worker starts (configuration, preflight, launcher variables, a damaged snapshot) checks the same
things in this process: the exit code, exactly one stderr line, no exception escaping `main`
(which is what prints a traceback), nothing written. A few cases in each catalogue still run as
a real subprocess, so the real command is proven end to end.

GPUs. The suite's tiers (the default, `-m slow`) are the CPU suite: gloo, with more processes than
a machine has GPUs. Where GPUs are visible torch would pick NCCL, which needs one per process, so
`pytest_configure` hides them (CUDA_VISIBLE_DEVICES="") from every case and the processes it
starts. The tests that need a GPU carry the `cuda` marker and are the GPU tier: GPUs stay visible
when the run selects exactly that tier, `python -m pytest -m cuda` (scripts/gpu-check.sh runs it,
docs/gpu.md), or when BRIGADE_TEST_GPU=1 is set (any other selection then sees the GPUs too, and
its multi-process cases pick NCCL: set it only to run cuda tests under another -m expression).
A `cuda` test skips, saying why, where torch sees no GPU: hidden by this file in the CPU tiers, or
none on the machine. tests/test_gpu_tier.py holds the tier to the tests it must collect.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.e2e.helpers import train

# A test that blocks in C with the GIL held still ends, with every thread's stack (see there);
# and an xdist_group runs on one worker under pytest 9 too (see there).
pytest_plugins = ["tests.watchdog", "tests.xdist_groups", "tests.tiers"]

GPU_TIER = "cuda"  # the marker, and the -m expression that runs the GPU tier with GPUs visible
HIDDEN = (f"needs a CUDA GPU, and tests/conftest.py hides GPUs from the CPU tiers: run "
          f"`python -m pytest -m {GPU_TIER}` (or set BRIGADE_TEST_GPU=1)")
_HIDDEN = pytest.StashKey[bool]()  # set where this run hid them


def gpus_hidden(markexpr: str, env) -> bool:
    """Whether a run with this -m expression and environment hides the GPUs (module docstring):
    every run but the GPU tier alone (`-m cuda`) or one with BRIGADE_TEST_GPU=1."""
    return markexpr.strip() != GPU_TIER and env.get("BRIGADE_TEST_GPU") != "1"


def pytest_configure(config: pytest.Config) -> None:
    # One folder of kept probes (`planner.probe_cache`) for the whole run, never the user's own:
    # made by the controller before its workers start, which inherit it.
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["BRIGADE_CACHE_DIR"] = tempfile.mkdtemp(prefix="brigade-test-cache-")
    # One cache of compiled code for every compile of the run, and of the runs after it: torch's
    # own default folder, which `brigade check`/`plan`/`bench --compile` use anyway, named so that
    # `brigade train --compile` uses it too instead of a cold OUT/compile-cache a run (20 s of
    # compiling saved a tiny run; `parallel.compiled.use_cache`). A graph found there is the code
    # the compiler would write; the first compile of each graph still compiles, and the test of a
    # run's own cache unsets it.
    os.environ.setdefault("BRIGADE_COMPILE_CACHE", inductor_default_cache())
    # `--log wandb` (the docs' commands too) writes its runs locally: no test reaches W&B's
    # servers, and none needs an account; MLflow's default is a file store in the run's folder.
    os.environ["WANDB_MODE"] = "offline"
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    config.addinivalue_line("markers", f"{GPU_TIER}: needs a CUDA GPU; the GPU tier, run by "
                            f"`python -m pytest -m {GPU_TIER}` (scripts/gpu-check.sh), skipped without one")
    # Before any case asks torch about CUDA (which reads the variable once, as CUDA starts).
    if gpus_hidden(config.getoption("markexpr", "") or "", os.environ):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        config.stash[_HIDDEN] = True


def inductor_default_cache() -> str:
    """Where inductor caches when TORCHINDUCTOR_CACHE_DIR is unset (torch's `default_cache_dir`,
    written out so the controller need not import torch)."""
    import getpass
    import re

    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


def pytest_unconfigure(config: pytest.Config) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER") and "brigade-test-cache-" in os.environ.get("BRIGADE_CACHE_DIR", ""):
        shutil.rmtree(os.environ["BRIGADE_CACHE_DIR"], ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A `cuda` test skips where torch sees no GPU, its reason saying whether the GPUs were hidden
    (run the GPU tier) or there are none; asked only when such a test was collected."""
    tier = [item for item in items if item.get_closest_marker(GPU_TIER)]
    if not tier:
        return
    import torch

    if torch.cuda.is_available():
        return
    empty = " (CUDA_VISIBLE_DEVICES is empty)" if os.environ.get("CUDA_VISIBLE_DEVICES") == "" else ""
    none = f"needs a CUDA GPU: none is visible to torch{empty}"
    reason = HIDDEN if config.stash.get(_HIDDEN, False) else none
    for item in tier:
        item.add_marker(pytest.mark.skip(reason=reason))


class NoWorkers(AssertionError):
    """Raised if an in-process case reached the point of starting worker processes."""


def _refuse_to_launch(*_args, **_kwargs):
    raise NoWorkers("this case must be refused before any worker starts, but brigade launched workers")


@pytest.fixture(autouse=True)
def _restore_environment():
    """Every test leaves os.environ as it found it.

    A process that joins a group alone (`groups.init` in this process) sets RANK, WORLD_SIZE and
    MASTER_PORT for itself; left behind, they would make every later subprocess believe a
    launcher started it, on a port this process still holds.
    """
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def cli(capfd, monkeypatch):
    """`cli(*args)` runs `brigade ARGS` in this process; returns a CompletedProcess (code, stdout, stderr).

    The elastic agent is replaced by a function that fails the test: these cases must be refused
    before any worker starts. An exception other than BrigadeError escapes (and fails the test),
    as it would print a traceback from the real command. The environment is restored after.
    """
    import torch.distributed.launcher.api as launcher_api

    from brigade.cli import main

    monkeypatch.setattr(launcher_api, "elastic_launch", _refuse_to_launch)
    saved = dict(os.environ)

    def run(*args) -> subprocess.CompletedProcess:
        argv = [str(a) for a in args]
        capfd.readouterr()  # only this command's output
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code
        finally:
            os.environ.clear()
            os.environ.update(saved)
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(["brigade", *argv], code, out, err)

    return run


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """A finished 6-step run with snapshots at steps 3 and 6 (read-only: copy it before damaging)."""
    out = tmp_path_factory.mktemp("tiny-run")
    result = train(out, "--max-steps", "6", "--snapshot-every", "3", "--sample-tokens", "0")
    assert result.returncode == 0, result.stderr
    return out
