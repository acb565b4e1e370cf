"""The activation-recompute modes a run may name (no torch import): the configuration owns the
names and what each means; `brigade.parallel.recompute` does it."""

from __future__ import annotations

MODES = {
    "none": "keep every activation the backward needs",
    "full": "keep each block's input and run its forward again in backward",
    "selective": "as full, but keep the matmul and attention outputs, so only the cheap ops run again",
}
