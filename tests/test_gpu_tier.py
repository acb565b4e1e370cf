"""The GPU tier (tests/conftest.py): `python -m pytest -m cuda` collects every test that needs a GPU,
and on a machine without one each skips with its reason; every other run hides the GPUs.

A test that needs CUDA but lost its `cuda` marker would skip in the CPU tiers and never run in the
GPU tier either: GPU_TESTS is the list the tier must collect, exactly, so that none drops out
silently (a new GPU test joins it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

from brigade.models.hf import families
from tests.conftest import GPU_TIER, HIDDEN, gpus_hidden

ROOT = Path(__file__).resolve().parents[1]
FLASH = "tests/models/hf/test_attention.py::test_on_a_gpu_the_flash_kernel_takes_a_batch_without_padding"
GPU_TESTS = sorted(f"{FLASH}[{family}]" for family in families.FAMILIES)


def test_only_the_gpu_tier_alone_or_brigade_test_gpu_leaves_the_gpus_visible():
    assert gpus_hidden("not slow", {}) and gpus_hidden("slow", {}) and gpus_hidden("", {})
    assert gpus_hidden("cuda or slow", {}) and gpus_hidden("not cuda", {}) and gpus_hidden("full", {})
    assert gpus_hidden("not slow and not full", {})
    assert not gpus_hidden(" cuda ", {}) and not gpus_hidden("not slow", {"BRIGADE_TEST_GPU": "1"})


def test_this_cpu_tier_hides_the_gpus(request):
    if not gpus_hidden(request.config.getoption("markexpr") or "", os.environ):
        pytest.skip("this run leaves the GPUs visible (BRIGADE_TEST_GPU=1)")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""


def _pytest(junit: Path, *args: str) -> subprocess.CompletedProcess:
    """pytest ARGS in a process of its own, its GPUs hidden as a CPU tier hides them (so that the
    outcome is the same on any machine), BRIGADE_TEST_GPU unset."""
    argv = [sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider", f"--junitxml={junit}", *args]
    env = {k: v for k, v in os.environ.items() if k != "BRIGADE_TEST_GPU"}
    return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=170,
                          env={**env, "CUDA_VISIBLE_DEVICES": ""})


def _skipped(junit: Path) -> dict[str, str | None]:
    """Each test the run collected, by id: its skip reason, or None where it did not skip."""
    cases = ElementTree.parse(junit).iter("testcase")
    return {f"{c.get('classname').replace('.', '/')}.py::{c.get('name')}":
            c.find("skipped").get("message") if c.find("skipped") is not None else None for c in cases}


@pytest.mark.timeout(180)
def test_the_gpu_tier_collects_every_gpu_test_and_each_skips_without_a_gpu(tmp_path):
    """The whole suite under `-m cuda`, as scripts/gpu-check.sh runs it: exactly GPU_TESTS, each
    skipped here with its reason (none visible to torch)."""
    done = _pytest(tmp_path / "tier.xml", "-m", GPU_TIER, "tests")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reason = "needs a CUDA GPU: none is visible to torch (CUDA_VISIBLE_DEVICES is empty)"
    assert _skipped(tmp_path / "tier.xml") == dict.fromkeys(GPU_TESTS, reason)


@pytest.mark.timeout(180)
def test_the_default_tier_skips_them_saying_the_gpus_are_hidden_and_how_to_run_them(tmp_path):
    done = _pytest(tmp_path / "default.xml", "-k", "on_a_gpu", "tests/models/hf/test_attention.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _skipped(tmp_path / "default.xml") == dict.fromkeys(GPU_TESTS, HIDDEN)
