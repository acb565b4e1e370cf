"""A host's CPU cores, as a pipeline's ranks share them (`plans.costs.Costs.cores`).

A GPU rank has its device to itself. CPU ranks on one host share its cores: four processes on two
cores each get half of one while all are busy, and a rank that waits lends its core to another.
So a schedule's bubble costs little there, and extra work (a split backward's I + W > B) costs in
full; `auto` weighs its candidates by that (`Simulation.on_cores`). The count is in ranks' worth:
a rank that computes on `threads` threads needs that many cores to run at its measured speed.
"""

from __future__ import annotations

import os


def host_cores() -> int:
    """The cores this process may run on (its affinity where the OS says, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def shared_cores(ranks: int, on_host: int, threads: int = 1, device_type: str = "cpu",
                 cores: int | None = None) -> float:
    """The cores a pipeline's `ranks` share, in ranks' worth, where the host gives each rank less
    than it needs; 0 where each has its own (a GPU, or cores enough).

    Args:
        ranks: the pipeline's ranks (p). on_host: every rank computing on this host (all
            pipelines', one per process, or one per thread of a local pipeline). threads: each
            rank's compute threads. device_type: the ranks' device ("cuda": not shared).
        cores: the host's cores (default: `host_cores()`).
    """
    if device_type != "cpu":
        return 0.0
    each = (cores or host_cores()) / (max(on_host, 1) * max(threads, 1))
    return ranks * each if each < 1 else 0.0
