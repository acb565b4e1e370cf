"""`brigade tune`: choose the split size (micro-batch count), schedule and cut points.

    1. measure each block's forward, backward and weight-gradient time at a few
       micro-batch sizes (the two processes measure different sizes at once),
       and the time to send one activation across the cut;
    2. for every (schedule, m) of the sweep: interpolate block costs at that
       micro-batch size, cut where the stage maxima are smallest (the solver),
       predict the step with simulate();
    3. time only the best few predictions (at most a third of the sweep) and keep the fastest.

`--verify` also times the whole sweep, the chosen configuration again among the others,
to show how close the choice is. Blocks, batches and transfers live on the process's device;
every time is read after synchronising it.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from torch import nn

from brigade import groups
from brigade.bench.experiments import BenchConfig, scaled_splits
from brigade.bench.place import place_model
from brigade.bench.timing import measure, ping_pong, stage_costs, time_pipeline
from brigade.models import load_model
from brigade.pipeline.partition import solve, split
from brigade.pipeline.pipe import Pipeline
from brigade.pipeline.plan import simulate
from brigade.pipeline.schedule import build


def block_costs(blocks: list[nn.Module], x: torch.Tensor, loss_fn, y) -> list[tuple[float, float, float]]:
    """(forward, backward, weight) seconds of every block on input batch x (blocks on x's device)."""
    out = []
    h = x
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        out.append(stage_costs(block, h, loss_fn if last else None, y if last else None,
                               first=i == 0, repeats=3))
        with torch.no_grad():
            h = block(h)
    return out


def _interpolate(samples: dict[int, list], size: int) -> list[tuple[float, float, float]]:
    """Per-block costs at micro-batch `size`, linear between the measured sizes."""
    sizes = sorted(samples)
    lo = max([s for s in sizes if s <= size], default=sizes[0])
    hi = min([s for s in sizes if s >= size], default=sizes[-1])
    if lo == hi:
        return [tuple(c * size / lo for c in block) for block in samples[lo]]
    t = (size - lo) / (hi - lo)
    return [tuple(a + t * (b - a) for a, b in zip(ca, cb)) for ca, cb in zip(samples[lo], samples[hi])]


def predict(samples: dict[int, list], batch: int, m: int, schedule: str, n_stages: int,
            comm_per_sample: float) -> tuple[float, list[int]]:
    """Predicted step seconds and the balance that minimises the slowest stage."""
    size = math.ceil(batch / m)
    costs = _interpolate(samples, size)
    balance = solve([f + b for f, b, _ in costs], n_stages)
    bounds = [0, *[sum(balance[: k + 1]) for k in range(n_stages)]]
    per = [[sum(c[j] for c in costs[a:b]) for a, b in zip(bounds, bounds[1:])] for j in range(3)]
    sim = simulate(build(schedule, n_stages, m), per[0], per[1], comm=comm_per_sample * size,
                   weight=per[2])
    return sim.makespan, balance


def _time_config(spec, x, y, rank, n, schedule, m, balance, cfg) -> float:
    stages = split(copy.deepcopy(spec.blocks), balance)  # copies stay on the blocks' device, x's
    pipe = Pipeline(stages[rank], schedule, m, spec.loss_fn, device=x.device)
    return time_pipeline(pipe, stages[rank], x, y, cfg).mean_s


def _comm_per_sample(spec, x, rank) -> float:
    """Seconds to move one sample's activation across a middle cut (one way, from a round trip)."""
    mid = len(spec.blocks) // 2
    with torch.no_grad():
        h = nn.Sequential(*spec.blocks[:mid])(x[:4])
    t = torch.zeros_like(h)  # on the blocks' device, as the pipeline's activations are
    peer = 1 - rank

    return measure(lambda: ping_pong(t, peer, rank == 0), 5, 2, device=x.device,
                   distributed=True).mean_s / 2 / 4


def verify_sweep(predictions: list[dict], chosen: dict, time_config) -> dict:
    """Time every configuration of the sweep afresh, the chosen one among them.

    The search's own timing of the chosen configuration is kept apart (`search_mean_s`):
    reusing it would compare one measurement taken earlier, under other conditions,
    with the sweep's, and could make the choice look better than it is.

    Args:
        predictions: the sweep's configurations (schedule, microbatches, balance, ...).
        chosen: the configuration the search kept; one of `predictions`.
        time_config: configuration -> measured seconds per step.

    Returns:
        sweep (every configuration with its new `mean_s`), sweep_best, sweep_best_mean_s,
        chosen_sweep_mean_s (the chosen configuration's time in this sweep) and within
        (chosen_sweep_mean_s / sweep_best_mean_s - 1).
    """
    sweep = []
    for c in predictions:
        row = {k: v for k, v in c.items() if k != "mean_s"}
        if "mean_s" in c:
            row["search_mean_s"] = c["mean_s"]
        row["mean_s"] = time_config(row)
        sweep.append(row)
    best = min(sweep, key=lambda r: r["mean_s"])
    mine = next(r for r in sweep if (r["schedule"], r["microbatches"]) ==
                (chosen["schedule"], chosen["microbatches"]))
    return {"sweep": sweep, "sweep_best": best, "sweep_best_mean_s": best["mean_s"],
            "chosen_sweep_mean_s": mine["mean_s"], "within": mine["mean_s"] / best["mean_s"] - 1}


def worker(cfg: BenchConfig, verify: bool) -> dict:
    info = groups.init(cfg.backend, threads=1)
    rank, n = info.rank, info.world_size
    spec = load_model(cfg.model, seed=cfg.seed, **cfg.model_options)
    x, y = place_model(spec, cfg.batch_size, cfg.seed, info.device)
    splits = cfg.splits or scaled_splits(cfg.batch_size)
    ms = sorted({math.ceil(cfg.batch_size / s) for s in splits})
    space = [(s, m) for s in cfg.schedules for m in ms]
    sizes = sorted({math.ceil(cfg.batch_size / m) for m in (ms[0], ms[len(ms) // 2], ms[-1])})
    mine = {s: block_costs(copy.deepcopy(spec.blocks), x[:s], spec.loss_fn, y[:s])
            for k, s in enumerate(sizes) if k % n == rank}
    parts: list = [None] * n
    dist.all_gather_object(parts, mine)
    samples = {s: c for part in parts for s, c in part.items()}
    comm = _comm_per_sample(spec, x, rank)
    predictions = sorted(
        ({"schedule": s, "microbatches": m, "predicted_s": p, "balance": bal}
         for (s, m) in space for p, bal in [predict(samples, cfg.batch_size, m, s, n, comm)]),
        key=lambda r: r["predicted_s"])
    budget = max(1, min(3, len(space) // 3))
    for cand in predictions[:budget]:
        cand["mean_s"] = _time_config(spec, x, y, rank, n, cand["schedule"], cand["microbatches"],
                                      cand["balance"], cfg)
    chosen = min(predictions[:budget], key=lambda r: r["mean_s"])
    result = {"trials": budget, "sweep_trials": len(space), "chosen": chosen,
              "chosen_mean_s": chosen["mean_s"], "predictions": predictions,
              "measured_sizes": sizes, "comm_s_per_sample": comm}
    if verify:
        result.update(verify_sweep(predictions, chosen, lambda c: _time_config(
            spec, x, y, rank, n, c["schedule"], c["microbatches"], c["balance"], cfg)))
    groups.destroy()
    return result
