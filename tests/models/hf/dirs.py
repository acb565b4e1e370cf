"""Tiny random Hugging Face directories for the tests, written once per process (no network)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the hf extra (scripts/setup.sh installs it)")

from brigade.models.hf import tiny  # noqa: E402


@functools.cache
def tiny_dir(family: str = "llama", layers: int = 4, tie: bool = True, **extra) -> str:
    """`tiny.write(...)` into a fresh temporary folder; the same arguments, the same folder."""
    out = Path(tempfile.mkdtemp(prefix=f"brigade-hf-{family}-")) / "model"
    tiny.write(out, family, layers, tie, **extra)
    return str(out)


def hf(family: str = "llama", **kw) -> str:
    """`--model` for a tiny directory."""
    return f"hf:{tiny_dir(family, **kw)}"
