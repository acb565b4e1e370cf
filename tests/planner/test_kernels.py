"""planner.kernels: what Inductor's fusion is counted as reading."""

from __future__ import annotations

import gc
import weakref

import torch

from brigade.planner.kernels import Fusion


def test_a_tensor_read_in_a_region_is_held_until_the_region_ends():
    """Reads are remembered by id; a freed tensor's id may be the next tensor's, which would then
    read as already read (free): the plans changed with PYTHONHASHSEED until each read tensor was
    held to the region's end."""
    fusion = Fusion()
    t = torch.empty(4, 4, device="meta")
    assert fusion.reads(t) == 64 and fusion.reads(t) == 0  # read from memory once per region
    gone = weakref.ref(t)
    del t
    gc.collect()
    assert gone() is not None  # held: its id stays its own
    fusion.boundary()
    gc.collect()
    assert gone() is None  # a new region forgets it
