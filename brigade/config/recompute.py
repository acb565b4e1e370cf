"""The activation-recompute modes a run may name (no torch import): the configuration owns the
names and what each means; `brigade.parallel.recompute` does it."""

from __future__ import annotations

MODES = {
    "none": "keep every activation the backward needs",
    "full": "keep each block's input and run its forward again in backward",
    "selective": "as full, but keep the matmul and attention outputs, so only the cheap ops run again",
    "op": "as selective, but every second matmul's output is made again too (torchtitan's 'op' policy)",
}
