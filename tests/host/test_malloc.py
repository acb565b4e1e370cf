"""brigade.host.malloc: malloc keeps freed memory for the next step (glibc on Linux, as on CI)."""

import os
import subprocess
import sys

import pytest

from brigade.host import malloc

# Three 8 MiB blocks taken and given back, 40 times: with glibc's default policy they are mapped
# and unmapped each round and faulted in again; with freed memory kept they are faulted in once.
_PROBE = """
import resource, sys
import torch
from brigade.host import malloc
kept = malloc.keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):
    blocks = [torch.ones(2 << 20) for _ in range(3)]
    del blocks
before = faults()
for _ in range(40):
    blocks = [torch.ones(2 << 20) for _ in range(3)]
    del blocks
print(kept, faults() - before)
"""


def _probe(setting: str) -> tuple[bool, int]:
    env = {**os.environ, malloc.ENV: setting}
    if setting == "0":
        # glibc's default threshold, held fixed: left dynamic, it rises to a block's size after the
        # first is freed, and whether the heap's top is then trimmed depends on what else sits on
        # the heap (a clean-clone CI run once saw 2048 faults instead of ~240000)
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 << 10)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_kept_memory_is_not_faulted_in_again():
    kept, kept_faults = _probe("1")
    released, released_faults = _probe("0")
    assert kept and not released
    pages = 40 * 3 * (8 << 20) // 4096
    assert released_faults > pages // 2  # the defaults fault most of the blocks in again
    assert kept_faults * 10 < released_faults, (kept_faults, released_faults)


@pytest.mark.parametrize("value", ["0", "off", "false", "No"])
def test_switched_off_by_the_environment(monkeypatch, value):
    monkeypatch.setenv(malloc.ENV, value)
    assert not malloc._enabled()


def test_the_bench_flag_leaves_malloc_alone_in_its_workers_only(monkeypatch):
    from brigade.bench.run import _malloc_defaults

    monkeypatch.setenv(malloc.ENV, "1")
    with _malloc_defaults(True):
        assert not malloc._enabled()  # what each worker reads as it joins the group
    assert malloc._enabled()
    monkeypatch.delenv(malloc.ENV)
    with _malloc_defaults(False):
        assert malloc.ENV not in os.environ
    assert malloc.ENV not in os.environ
