"""Copies of a model's blocks for the bench's rows and the tuner's trials, compiled under --compile
as `brigade train --compile` compiles them (`parallel.compiled`).

A copy is made first and compiled after, never the other way: `copy.deepcopy` of a compiled
block keeps its `forward` (a `_Compiled`) bound to the block it was copied from, so the copy
would run, and train, the original's parameters while its own stay untouched.
"""

from __future__ import annotations

import copy

from torch import nn

from brigade.parallel import recompute
from brigade.parallel.compiled import compile_blocks


def copy_blocks(blocks: list[nn.Module], compile: bool = False) -> list[nn.Module]:
    """A deep copy of `blocks` (shared weights stay shared), with `compile` each copied block's
    forward compiled as --compile compiles it (`parallel.compiled`; a block declaring selective
    recompute stays eager, as there).

    Copied first, then compiled, never the other way: the deep copy of a compiled block keeps a
    forward bound to the original block, so it would run, and train, the original's parameters.
    """
    copies = copy.deepcopy(blocks)
    if compile:
        # (compile_blocks raises torch's limit of compiled variants a process keeps: the bench runs
        # each block kind with and without grad, at several micro-batch sizes)
        compile_blocks(copies, list(range(len(copies))), recompute.modes(copies, "none"))
    return copies
