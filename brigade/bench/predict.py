"""The tuner's predictions: block costs measured at a few micro-batch sizes, interpolated to
any size, and a step's time for every layout of the search space (`simulate()` over the
solver's cut for a pipeline; one device's step on its share plus the all-reduce for DDP).
Measuring is `block_costs`; the rest is arithmetic on its figures.
"""

from __future__ import annotations

import math
from dataclasses import asdict

from brigade.pipeline.plans.generate import Costs
from brigade.pipeline.plans.schedule import SCHEDULES, build
from brigade.pipeline.plans.simulate import simulate
from brigade.pipeline.stages.partition import solve

ANY_VIRTUAL = (1, 2)  # V tried for a schedule that takes any: more would need ≥ 3·p blocks


def interpolate(samples: dict[int, list], size: int) -> list[tuple[float, ...]]:
    """Per-block costs at micro-batch `size`, linear between the measured sizes."""
    sizes = sorted(samples)
    lo = max([s for s in sizes if s <= size], default=sizes[0])
    hi = min([s for s in sizes if s >= size], default=sizes[-1])
    if lo == hi:
        return [tuple(c * size / lo for c in block) for block in samples[lo]]
    t = (size - lo) / (hi - lo)
    return [tuple(a + t * (b - a) for a, b in zip(ca, cb)) for ca, cb in zip(samples[lo], samples[hi])]


def search_space(schedules: list[str], ms: list[int], ranks: int,
                 n_blocks: int) -> tuple[list[dict], list[dict]]:
    """The pipelined configurations to predict, and the (schedule, V) left out with why.

    Args:
        schedules: registry names. ms: micro-batch counts. ranks: pipeline ranks (p).
        n_blocks: the model's blocks; p·V stages need as many.

    Returns:
        (rows with schedule, virtual, microbatches, dp = 1, pp = ranks; left_out rows with a reason).
    """
    rows, left_out = [], []
    for name in schedules:
        fixed = SCHEDULES[name].virtual
        for v in (fixed,) if fixed else ANY_VIRTUAL:
            if n_blocks < ranks * v:
                left_out.append({"schedule": name, "virtual": v, "reason":
                                 f"the model has {n_blocks} blocks: {ranks * v} stages (p={ranks} × V={v}) "
                                 f"need as many"})
                continue
            rows += [{"schedule": name, "virtual": v, "microbatches": m, "dp": 1, "pp": ranks} for m in ms]
    return rows, left_out


def predict(samples: dict[int, list], batch: int, m: int, schedule: str, ranks: int,
            comm_per_sample: float, virtual: int = 1, row: dict | None = None,
            cores: float = 0.0) -> tuple[float, list[int]]:
    """Predicted step seconds and the balance of p·V stages that minimises the slowest one.

    Args:
        samples: micro-batch size -> per-block (forward, backward, weight, input) seconds.
        ranks: pipeline ranks p; virtual: stages per rank V (the plan has p·V stages).
        comm_per_sample: seconds to move one sample's activation between ranks.
        row: where a costed schedule's (auto's) costs are kept as `costs`, for `plan_costs`: the
            step that is timed must run the plan that was predicted.
        cores: the cores the ranks share where they outnumber them (`generate.Costs.cores`): a
            costed schedule plans for them.

    Returns:
        (simulated makespan, blocks per stage: p·V entries).
    """
    size = math.ceil(batch / m)
    costs = interpolate(samples, size)
    n_stages = ranks * virtual
    balance = solve([f + b for f, b, *_ in costs], n_stages)
    bounds = [0, *[sum(balance[: k + 1]) for k in range(n_stages)]]
    per = [[sum(c[j] for c in costs[a:b]) for a, b in zip(bounds, bounds[1:])] for j in range(4)]
    planned = None
    if SCHEDULES[schedule].costed:
        planned = Costs(tuple(per[0]), tuple(per[3]), tuple(per[2]), backward=tuple(per[1]),
                        comm=comm_per_sample * size, cores=cores)
        if row is not None:
            row["costs"] = asdict(planned)
    sim = simulate(build(schedule, ranks, m, virtual, planned), per[0], per[1], comm=comm_per_sample * size,
                   weight=per[2], input_grad=per[3])
    return sim.makespan, balance


def plan_costs(row: dict) -> Costs | None:
    """The costs a costed row was predicted on (`predict(row=...)`), as the plan takes them; None
    for the other schedules."""
    kept = row.get("costs")
    if kept is None:
        return None
    return Costs(**{k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in kept.items()})


def predict_ddp(samples: dict[int, list], batch: int, dp: int, allreduce_s: float) -> float:
    """Data parallel's predicted step: one device's forward and backward on 1/dp of the batch,
    then the gradients' all-reduce (not overlapped with the backward: an upper bound)."""
    costs = interpolate(samples, math.ceil(batch / dp))
    return sum(f + b for f, b, *_ in costs) + allreduce_s


def ddp_row(samples: dict[int, list], batch: int, dp: int, allreduce_s: float) -> dict:
    """The data-parallel candidate: the whole model on every one of `dp` processes."""
    return {"schedule": None, "virtual": 1, "microbatches": 1, "balance": None, "dp": dp, "pp": 1,
            "predicted_s": predict_ddp(samples, batch, dp, allreduce_s)}
