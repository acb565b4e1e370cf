"""The tuner's predictions: a step's time for every configuration of its sweep (`space.search_space`
and data parallel), from block costs measured at a few micro-batch sizes and interpolated to any
(`costs.interpolate`): `simulate()` over the solver's cut for a pipeline, one device's step on its
share plus the all-reduce for DDP. Measuring is `measure.stages.block_costs`; the rest is
arithmetic on its figures, the cut and the costed plan shared with the planner's own prediction
(`predict.cut`, `predict.costed`).
"""

from __future__ import annotations

import math
from dataclasses import asdict

from brigade.pipeline.plans.costs import Costs
from brigade.pipeline.plans.schedule import build
from brigade.pipeline.plans.simulate import simulate
from brigade.planner.costs import interpolate
from brigade.planner.predict import costed, cut


def predict_pipeline(samples: dict[int, list], batch: int, m: int, schedule: str, ranks: int,
                     comm_per_sample: float, virtual: int = 1, row: dict | None = None,
                     cores: float = 0.0) -> tuple[float, list[int]]:
    """Predicted step seconds and the balance of p·V stages that minimises the slowest one.

    Args:
        samples: micro-batch size -> per-block (forward, backward, weight, input) seconds.
        ranks: pipeline ranks p; virtual: stages per rank V (the plan has p·V stages).
        comm_per_sample: seconds to move one sample's activation between ranks.
        row: where a costed schedule's (auto's) costs are kept as `costs`, for `plan_costs`: the
            step that is timed must run the plan that was predicted.
        cores: the cores the ranks share where they outnumber them (`plans.costs.Costs.cores`): a
            costed schedule plans for them.

    Returns:
        (simulated makespan, blocks per stage: p·V entries).
    """
    size = math.ceil(batch / m)
    balance, per = cut(interpolate(samples, size), ranks * virtual)
    planned = costed(schedule, per, comm_per_sample * size, cores)
    if planned is not None and row is not None:
        row["costs"] = asdict(planned)
    sim = simulate(build(schedule, ranks, m, virtual, planned), per[0], per[1], comm=comm_per_sample * size,
                   weight=per[2], input_grad=per[3])
    return sim.makespan, balance


def plan_costs(row: dict) -> Costs | None:
    """The costs a costed row was predicted on (`predict_pipeline(row=...)`), as the plan takes
    them; None for the other schedules."""
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


def label(row: dict) -> str:
    """A configuration of the sweep for people: "ddp, dp=2" or "interleaved, V=2, m=8"."""
    if row["dp"] > 1:
        return f"ddp, dp={row['dp']}"
    return f"{row['schedule']}, V={row['virtual']}, m={row['microbatches']}"
