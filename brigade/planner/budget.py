"""`brigade tune --memory-per-device`: what each configuration of the sweep would hold at its peak
on its busiest process, and which fit.

The figures are `brigade plan`'s memory model (`planner.memory.rank_memory`: parameters, gradients,
AdamW's two moments, the activations the plan holds at once per `simulate()`'s `peak_held`, a
block's working set and temporaries, DDP's buckets), on bytes measured once here by rank 0
(`planner.costs.measure_memory`) and shared by the tuner (`bench.tune.shared_costs`), so every
rank keeps the same configurations. A
configuration that would not fit is never timed nor chosen; the JSON lists it with its figure.
"""

from __future__ import annotations

import math
import re

from brigade.errors import BrigadeError
from brigade.pipeline.plans.schedule import build
from brigade.pipeline.plans.simulate import simulate
from brigade.planner.costs import ModelCosts
from brigade.planner.memory import moments, rank_memory, worst
from brigade.planner.space import Layout
from brigade.planner.sweep import label, plan_costs

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str, flag: str = "--memory-per-device") -> float:
    """``"8GiB"``, ``"512MB"`` or ``"1e9"`` in bytes (0: no limit).

    Raises:
        BrigadeError: anything else, in one line.
    """
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    unit = match[2].lower() if match else ""
    try:
        value = float(match[1]) * _UNITS[unit] if match else -1.0
    except (ValueError, KeyError):
        value = -1.0
    if value < 0:
        raise BrigadeError(f"{flag} {text!r}: expected a size like 8GiB, 512MB or a number of bytes "
                           "(units: B, KB, MB, GB, KiB, MiB, GiB)")
    return value


def size_text(n: float) -> str:
    """``"12.3 MiB"``: bytes in the largest binary unit under which the number is at least 1."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def peak_bytes(costs: ModelCosts, row: dict, batch: int) -> float:
    """The busiest process's predicted peak bytes for one configuration of the tuner's sweep."""
    if row["dp"] > 1:  # data parallel: the whole model on each process, its share of the batch
        layout = Layout(row["dp"], 1, 1, "gpipe", 1, 1, "none")
        one = moments(build("gpipe", 1, 1))  # one micro-batch: its activations, then its gradients
        mb = math.ceil(batch / row["dp"])
        return rank_memory(costs, layout, [costs.n_blocks], {0: 1}, mb, 0, one)["peak"]
    layout = Layout(1, 1, row["pp"], row["schedule"], row["virtual"], row["microbatches"], "none")
    plan = build(row["schedule"], row["pp"], row["microbatches"], row["virtual"], plan_costs(row))
    held, when = simulate(plan, 1.0).peak_held, moments(plan)  # moments: what a split backward keeps
    mb = math.ceil(batch / row["microbatches"])
    return worst([rank_memory(costs, layout, row["balance"], held, mb, r, when)
                  for r in range(row["pp"])])["peak"]


def keep_fitting(rows: list[dict], costs: ModelCosts, batch: int,
                 limit: float) -> tuple[list[dict], list[dict]]:
    """(the rows whose predicted peak fits `limit`, each with `predicted_peak_bytes`; the others).

    Raises:
        BrigadeError: no row fits, naming the smallest figure.
    """
    for row in rows:
        row["predicted_peak_bytes"] = peak_bytes(costs, row, batch)
    fit = [r for r in rows if r["predicted_peak_bytes"] <= limit]
    if not fit:
        least = min(rows, key=lambda r: r["predicted_peak_bytes"])
        raise BrigadeError(f"--memory-per-device {size_text(limit)}: no configuration fits; the least "
                           f"({label(least)}) needs {size_text(least['predicted_peak_bytes'])} per "
                           "process: allow more memory or a smaller --batch-size")
    return fit, [r for r in rows if r not in fit]
