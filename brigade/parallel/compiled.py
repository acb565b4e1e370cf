"""Wrapper 3: each held block compiled on its own (`torch.compile`), after tensor parallel and
recompute, before sharding or replicating, as torchtitan orders them.

What is compiled is the block's own compute, its `forward`: module hooks (FSDP2's gathers and
frees, DDP's) stay outside the graph and run as they do eagerly, and a block under recompute
keeps recompute's saved-tensor hooks outside it too (`recompute.Recomputed` calls the compiled
forward; the graph's saved tensors become its tickets like any other). Parameter names do not
change, so snapshots, tied weights and `hf` weights are read and written as without compile.

One graph per block, not one per model: a block's graph is compiled once and every block of
the same shapes reuses it (guards on the code and shapes, not on which block); a pipeline stage
holds whole blocks, so any cut works. Selective recompute picks the ops it keeps by watching
them run (`recompute._Record`, a dispatch mode), which a compiled graph hides; a block under
selective recompute (and "op") is therefore left eager, and `compile_blocks` says which.

A forward that runs under a dispatch mode runs eagerly instead (`_Compiled`): the pipeline
watches a stage's first forward for random draws under one (`runtime.randomness`), and selective
recompute notes its kept ops under one. torch.compile cannot trace under such a mode; left to
itself it skips the frame and marks the block's code never to be compiled again, so one watched
forward would leave the whole run eager. Handed the eager forward there, the block compiles on
its next call.

A split backward (zero-bubble schedules) keeps the graph from the input pass to the weight pass
(`retain_graph`). AOTAutograd's donated buffers, a backward reusing its saved tensors' memory,
need a backward that frees the graph, and refuse it; `compile_blocks` turns them off for the
process (`torch._functorch.config.donated_buffer`): a compiled backward then holds its saved
tensors until it ends, as an eager one does.

Compiled code is cached on disk (inductor's FX graph cache and AOTAutograd's cache) under
`cache_dir(out)`: a restart of the same run, which starts fresh processes, finds its graphs
there instead of compiling again. Where BRIGADE_COMPILE_CACHE names a folder, every run compiles
into that one instead (one cache that many runs share, as the test suite's does). It is
brigade's own variable because torch writes TORCHINDUCTOR_CACHE_DIR itself, to its default, as
soon as torch._dynamo is imported, which the agent does before it forks its workers
(`launcher.agent`): set or not, that variable cannot say what the user chose.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from brigade.parallel.recompute import SELECTIVE, Recomputed

RECOMPILES = 64  # compiled variants one block's code may have (`compile_blocks`)


def cache_dir(out: str | Path) -> Path:
    """Where a run's compiled code is kept: OUT/compile-cache."""
    return Path(out) / "compile-cache"


SHARED = "BRIGADE_COMPILE_CACHE"  # a folder for every run's compiled code (module docstring)


def use_cache(out: str | Path) -> None:
    """Point inductor's on-disk caches at the run's folder (before anything compiles): the
    restarts of a run reuse what its first attempt compiled. Or at $BRIGADE_COMPILE_CACHE's,
    where it is set (module docstring)."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ.get(SHARED) or str(cache_dir(out))


class _Compiled:
    """A forward compiled, but run eagerly where a dispatch mode is active (module docstring)."""

    def __init__(self, forward):
        self.eager, self.compiled = forward, torch.compile(forward)

    def __call__(self, *args, **kwargs):
        if _current_dispatch_mode() is not None:
            return self.eager(*args, **kwargs)
        return self.compiled(*args, **kwargs)


def compile_blocks(blocks: list[nn.Module], indices: list[int], modes: list[str]) -> list[int]:
    """Compile the forwards of the held blocks `indices` in place; returns those left eager (under
    selective recompute, the module docstring). `modes`: every block's recompute mode."""
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False  # the module docstring: I and W share a graph
    # Every compiled forward runs in one frame of torch's (torch.compile wraps a bound method in one
    # shared function), whose cache holds each block kind's variants (each shape, grad on or off:
    # training, evaluation, sampling); past torch's default of 8 a new variant would run eagerly
    # for the rest of the process, with a warning only (the bench's toy model needs about 12).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILES)
    eager = []
    for i in indices:
        block = blocks[i]
        if modes[i] in SELECTIVE:
            eager.append(i)
        elif isinstance(block.forward, Recomputed):
            block.forward.inner = _Compiled(block.forward.inner)
        else:
            block.forward = _Compiled(block.forward)
    return eager
