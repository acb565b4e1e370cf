"""brigade: data, model and pipeline parallel training for PyTorch, on CPU or GPU, one machine or many.

The names below load on first use (PEP 562), so that `import brigade.config` or the pure
pipeline plans do not import torch through this file.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_WHERE = {
    "launch": "brigade.launcher.agent",
    "Trainer": "brigade.train.trainer",
    "Pipeline": "brigade.pipeline.pipe",
    "LocalPipeline": "brigade.pipeline.pipe",
    "ParallelConfig": "brigade.config",
    "OptimConfig": "brigade.config",
    "TrainConfig": "brigade.config",
    "RunConfig": "brigade.config",
    "BrigadeError": "brigade.errors",
    "unbatched": "brigade.pipeline.batches.microbatch",
}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'brigade' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
