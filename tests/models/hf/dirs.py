"""Tiny random Hugging Face directories for the tests, written once per process (no network), and
removed when the process that wrote them ends."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the hf extra (scripts/setup.sh installs it)")

from brigade.models.hf import tiny  # noqa: E402


@functools.cache
def tiny_dir(family: str = "llama", layers: int = 4, tie: bool = True, **extra) -> str:
    """`tiny.write(...)` into a fresh temporary folder; the same arguments, the same folder."""
    out = Path(tempfile.mkdtemp(prefix=f"brigade-hf-{family}-")) / "model"
    atexit.register(_remove, out.parent, os.getpid())
    tiny.write(out, family, layers, tie, **extra)
    return str(out)


def _remove(folder: Path, writer: int) -> None:
    """At exit, the folder `tiny_dir` made, by the process that made it alone (a forked child that
    runs its exit handlers leaves its parent's folders)."""
    if os.getpid() == writer:
        shutil.rmtree(folder, ignore_errors=True)


def hf(family: str = "llama", **kw) -> str:
    """`--model` for a tiny directory."""
    return f"hf:{tiny_dir(family, **kw)}"
