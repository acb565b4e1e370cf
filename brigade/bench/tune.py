"""`brigade tune`: choose the layout, schedule, stages per rank, split size and cut points.

    1. measure each block's forward, backward and weight-gradient time at a few
       micro-batch sizes (both processes measure every size at once, as both compute in a
       step, and their times are averaged), the time to send one activation across a cut,
       and the time to all-reduce the model's gradients;
    2. the space: every schedule × its stages per rank V (its fixed V, or 1 and 2 where it
       takes any, 2 only with ≥ 2·p blocks) × m of the sweep, each cut by the solver into
       p·V stages and predicted with simulate() on interpolated block costs (a costed
       schedule's, auto's, cut is chosen with its plan from the same costs instead:
       `predict_row`); plus data parallel (dp = p: one device's step on 1/p of the batch,
       plus the all-reduce);
    3. time only the best predictions (at most a third of the space, the best of data parallel
       and of the pipelines among them) in interleaved rounds (as many as --verify's: with
       fewer, noise on a shared machine picks), rank them within rounds (each round's times
       over its median: `bench.choose`), then time again, together, the best two and any
       other the rounds cannot tell from the best, and keep the fastest over every round
       they shared.

`--compile` compiles every copy of the blocks, those measured in 1. and those timed in 3.
(`Worker.copy_blocks`), and the train config written says `compile = true`.

`--verify` also times the whole space in interleaved rounds, the chosen configuration among
the others, to show how close the choice is; its best is ranked within rounds too. Blocks,
batches and transfers live on the process's device; every time is read after synchronising it.
"""

from __future__ import annotations

import gc
import math
import statistics
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from brigade.bench.cases import BenchConfig, scaled_splits
from brigade.bench.choose import pick_trials, scores
from brigade.bench.experiments import Worker, brigade_pipeline, replica_step, search_record, worlds
from brigade.host.cores import shared_cores
from brigade.launcher import groups
from brigade.measure.device import place_model
from brigade.measure.stages import block_costs
from brigade.measure.stats import median_ci_coverage, ratio_ci
from brigade.measure.timing import interleaved_rounds, measure, ping_pong, pipeline_step
from brigade.models import load_model
from brigade.pipeline.plans.cuts import choose_cut
from brigade.pipeline.plans.schedule import SCHEDULES
from brigade.planner.budget import keep_fitting
from brigade.planner.costs import ModelCosts, interpolate, measure_memory
from brigade.planner.predict import cut
from brigade.planner.space import search_space
from brigade.planner.sweep import ddp_row, label, plan_costs, predict_pipeline
from brigade.train.memory import quiet_stderr

TIMED = ("rounds_s", "mean_s", "relative", "final_rounds_s", "final_relative")  # what timing adds


def row_key(row: dict) -> str:
    """A configuration's name, the same on every rank (the interleaved rounds' key)."""
    if row["dp"] > 1:
        return f"ddp|dp{row['dp']}"
    return f"{row['schedule']}|V{row['virtual']}|m{row['microbatches']}"


@dataclass
class _Tuner(Worker):
    """Blocks copied once per balance and shared by rows."""

    blocks: dict[tuple[int, ...], list[nn.Module]] = field(default_factory=dict)


def _step(t: _Tuner, row: dict):
    """The callable every rank runs for one timed step of `row` (built now, timed later), its
    stages built by the assembler `brigade train` uses."""
    if row["dp"] > 1:
        return replica_step(t)
    cut = tuple(row["balance"])
    if cut not in t.blocks:  # copies stay on the blocks' device, x's; compiled under --compile
        t.blocks[cut] = t.copy_blocks()
    pipe, mine = brigade_pipeline(t, t.blocks[cut], list(cut), row["schedule"], row["virtual"],
                                  row["microbatches"], plan_costs(row))
    return pipeline_step(pipe, mine, t.x, t.y)


def _timer(t: _Tuner, rounds: int):
    """rows -> each row's seconds per step in every round, the rows timed together in interleaved
    rounds (round k of every row is one round)."""
    def time_all(rows: list[dict]) -> list[list[float]]:
        steps = {row_key(r): _step(t, r) for r in rows}
        times = interleaved_rounds(steps, rounds, t.cfg.warmup, t.x.device, seed=t.cfg.seed)
        return [times[row_key(r)] for r in rows]
    return time_all


def timed(rows: list[dict], time_all) -> None:
    """Time `rows` together with `time_all`; each gets `rounds_s`, `mean_s` (their median) and
    `relative`: the median over rounds of its time ÷ the round's median over `rows` (lower is
    faster; load common to a round cancels, see bench.choose)."""
    got = time_all(rows)
    for row, rounds, score in zip(rows, got, scores(got), strict=True):
        row["rounds_s"], row["mean_s"], row["relative"] = rounds, statistics.median(rounds), score


def search(trials: list[dict], time_all) -> dict:
    """Time `trials` together, time the finalists together again, keep the fastest.

    Both steps compare within rounds (bench.choose): the trials are ranked by `relative`; the
    finalists are the best two and every other trial the rounds cannot tell from the best (the
    95 % interval of its per-round ratio over the best reaches 1), ranked by the same taken
    over them alone (`final_relative`) and over every round they shared: the trials' rounds
    and their own. A second look costs a few steps; it gives the close calls twice the rounds,
    each round shorter (fewer configurations), so less of it falls in a burst of load that
    hit only part of a round.

    Args:
        trials: configurations to time; each gets `rounds_s`, `mean_s` and `relative`, each
            finalist also `final_rounds_s`, `final_relative` and `mean_s` over all its rounds.
        time_all: configurations -> their seconds per step in every round, in order (timed
            together in interleaved rounds, every one warmed before the first).

    Returns:
        the chosen trial.
    """
    timed(trials, time_all)
    ranked = sorted(trials, key=lambda r: r["relative"])  # stable: ties keep prediction order
    if len(ranked) < 2:
        return ranked[0]
    best = ranked[0]["rounds_s"]
    top = ranked[:2] + [r for r in ranked[2:] if ratio_ci(r["rounds_s"], best)[1] <= 1]
    for row, rounds in zip(top, time_all(top), strict=True):
        row["final_rounds_s"] = rounds
    shared = [row["rounds_s"] + row["final_rounds_s"] for row in top]
    for row, score, rounds in zip(top, scores(shared), shared):
        row["final_relative"], row["mean_s"] = score, statistics.median(rounds)
    return min(top, key=lambda r: r["final_relative"])


def verify_sweep(predictions: list[dict], chosen: dict, time_all) -> dict:
    """Time every configuration of the sweep afresh, in interleaved rounds, the chosen one among them.

    The search's own timing of the chosen configuration is kept apart (`search_mean_s`):
    reusing it would compare one measurement taken earlier, under other conditions,
    with the sweep's, and could make the choice look better than it is. For the same reason
    the best is the lowest `relative` (ranked within rounds), not the lowest median, and
    `within` is the median of the per-round ratios: a ratio of two medians taken over rounds
    that bursts of load hit unevenly says where the bursts fell (see bench.choose).

    Args:
        predictions: the sweep's configurations (schedule, virtual, microbatches, dp, balance, ...).
        chosen: the configuration the search kept; one of `predictions`.
        time_all: configurations -> their seconds per step in every round, in order (timed
            together in interleaved rounds).

    Returns:
        sweep (every configuration with its new `mean_s`, the median of its `rounds_s`, and
        `relative`), sweep_best (the lowest `relative`), sweep_best_mean_s, chosen_sweep_mean_s
        (the chosen configuration's median in this sweep), within (the median over rounds of
        chosen / best, minus 1: 0 when the best is the choice, below 0 when the choice was the
        faster in most rounds though not the lowest `relative`) and within_ci (its 95 % interval,
        whether the gap is noise) with within_ci_coverage (below 6 rounds the interval is their
        range, and covers less).
    """
    sweep = []
    for c in predictions:
        row = {k: v for k, v in c.items() if k not in TIMED}
        if "mean_s" in c:
            row["search_mean_s"] = c["mean_s"]
        sweep.append(row)
    timed(sweep, time_all)
    best = min(sweep, key=lambda r: r["relative"])
    mine = next(r for r in sweep if row_key(r) == row_key(chosen))
    ratio, lo, hi = ratio_ci(mine["rounds_s"], best["rounds_s"])
    return {"sweep": sweep, "sweep_best": best, "sweep_best_mean_s": best["mean_s"],
            "chosen_sweep_mean_s": mine["mean_s"], "within": ratio - 1,
            "within_ci": [lo - 1, hi - 1], "within_ci_coverage": median_ci_coverage(len(mine["rounds_s"]))}


def predict_row(row: dict, samples: dict[int, list], batch: int, ranks: int, comm_per_sample: float,
                cores: float) -> None:
    """A pipelined row's `predicted_s` and `balance` (and a costed row's `costs`, what its plan is
    made on). The solver cuts the blocks for the hand-written schedules (`sweep.predict_pipeline`);
    a costed schedule's (auto's) cut is chosen with its plan from the same interpolated block
    costs, seeded with the solver's (`cuts.choose_cut`, on the transfer and the shared cores the
    plan is made for), and its `cut_search` says how the two compare. Its prediction is the
    plan's makespan with the transfer, as the other rows' is."""
    m, v = row["microbatches"], row["virtual"]
    if not SCHEDULES[row["schedule"]].costed:
        row["predicted_s"], row["balance"] = predict_pipeline(samples, batch, m, row["schedule"], ranks,
                                                              comm_per_sample, v, row=row, cores=cores)
        return
    size = math.ceil(batch / m)
    blocks = interpolate(samples, size)
    solver = cut(blocks, ranks * v)[0]
    got = choose_cut(blocks, ranks, m, (v,), given=[solver], comm=comm_per_sample * size, cores=cores)
    row["predicted_s"], row["balance"], row["costs"] = got.makespan, list(got.balance), asdict(got.costs)
    row["cut_search"] = search_record(got, solver)


def _comm_per_sample(spec, x, rank) -> float:
    """Seconds to move one sample's activation across a middle cut (one way, from a round trip)."""
    mid = max(1, len(spec.blocks) // 2)
    with torch.no_grad():
        h = nn.Sequential(*spec.blocks[:mid])(x[:4])
    t = torch.zeros_like(h)  # on the blocks' device, as the pipeline's activations are
    peer = 1 - rank
    return measure(lambda: ping_pong(t, peer, rank == 0), 5, 2, device=x.device,
                   distributed=True).mean_s / 2 / len(t)


def _allreduce_s(blocks: list[nn.Module], device: torch.device) -> float:
    """Median seconds to all-reduce as many bytes as the model's gradients (a shared weight once),
    in one flat tensor of each dtype on the process's device."""
    numel: dict[torch.dtype, int] = {}
    for p in {id(p): p for b in blocks for p in b.parameters()}.values():
        numel[p.dtype] = numel.get(p.dtype, 0) + p.numel()
    flats = [torch.zeros(n, dtype=dtype, device=device) for dtype, n in numel.items()]
    timing = measure(lambda: [dist.all_reduce(f) for f in flats], 3, 1, device=device, distributed=True)
    return statistics.median(timing.samples)


def shared_costs(spec, size: int, rank: int) -> ModelCosts:
    """Rank 0's memory measurement of `spec` at micro-batch `size`, on every rank: every rank then
    leaves out the same configurations (`planner.budget.keep_fitting`)."""
    if rank == 0:
        with quiet_stderr():  # the profiler's start/stop lines
            got = [measure_memory(spec, size, ["none"])]
    else:
        got = [None]
    dist.broadcast_object_list(got, src=0)
    return got[0]


def _samples(t: _Tuner, sizes: list[int]) -> dict[int, list]:
    """Block costs at every size in `sizes`, measured by every rank at once, averaged over ranks.

    Both ranks busy is how a step runs: a rank measuring alone while the other waits (one size
    each) saw a freer machine for the larger size and under-predicted data parallel by a third.
    Under --compile the blocks measured are compiled, as the trials' are (`stage_costs` leaves
    out its first calls, the compiler's).
    """
    mine = {s: block_costs(t.copy_blocks(), t.x[:s], t.spec.loss_fn, t.y[:s]) for s in sizes}
    parts: list = [None] * t.ranks
    dist.all_gather_object(parts, mine)

    def mean(size: int, block: int) -> tuple[float, ...]:  # (forward, backward, weight, input) over ranks
        return tuple(statistics.fmean(c) for c in zip(*(part[size][block] for part in parts)))
    return {s: [mean(s, i) for i in range(len(t.spec.blocks))] for s in sizes}


def worker(cfg: BenchConfig, verify: bool) -> dict:
    """Predict the space, time the best third in interleaved rounds and its finalists again,
    keep the fastest; `verify`: time the whole space too. Returns the JSON of `brigade tune`
    (rank 0's is kept)."""
    info = groups.init(cfg.backend, threads=1)
    result = _tune(cfg, info, verify)
    # Every step (DDP's reducer, the pipelines) is gone before the group: a gloo group freed
    # last by a DDP reducer joins its worker thread holding the GIL, which that thread needs.
    gc.collect()
    groups.destroy()
    return result


def _tune(cfg: BenchConfig, info, verify: bool) -> dict:
    """The worker's body: everything it builds is freed when this returns."""
    spec = load_model(cfg.model, seed=cfg.seed, **cfg.model_options)
    x, y = place_model(spec, cfg.batch_size, cfg.seed, info.device)
    t = _Tuner(cfg, spec, x, y, info.rank, info.world_size, *worlds(info.world_size, info.device))
    ms = sorted({math.ceil(cfg.batch_size / s) for s in cfg.splits or scaled_splits(cfg.batch_size)})
    rows, left_out = search_space(cfg.schedules, ms, t.ranks, len(spec.blocks))
    dp_size = math.ceil(cfg.batch_size / t.ranks)  # what one data-parallel process steps on
    sizes = sorted({dp_size, *(math.ceil(cfg.batch_size / m) for m in (ms[0], ms[len(ms) // 2], ms[-1]))})
    samples = _samples(t, sizes)
    comm = _comm_per_sample(spec, x, t.rank)
    allreduce = _allreduce_s(spec.blocks, x.device)
    cores = shared_cores(t.ranks, t.ranks, torch.get_num_threads(), x.device.type)  # one host
    for r in rows:
        predict_row(r, samples, cfg.batch_size, t.ranks, comm, cores)
    predictions = sorted([*rows, ddp_row(samples, cfg.batch_size, t.ranks, allreduce)],
                         key=lambda r: r["predicted_s"])
    candidates, too_big = predictions, []
    if cfg.memory_per_device:  # what would not fit is never timed nor chosen
        memory = shared_costs(t.spec, min(sizes), t.rank)
        candidates, too_big = keep_fitting(predictions, memory, cfg.batch_size, cfg.memory_per_device)
    budget = max(1, min(3, len(candidates) // 3))
    trials = pick_trials(candidates, budget)
    chosen = search(trials, _timer(t, cfg.rounds))
    result = {"trials": budget, "finalists": sum("final_rounds_s" in r for r in trials),
              "sweep_trials": len(predictions), "chosen": chosen, "chosen_label": label(chosen),
              "chosen_mean_s": chosen["mean_s"], "predictions": predictions,
              "left_out": left_out, "too_big": too_big, "memory_per_device": cfg.memory_per_device,
              "measured_sizes": sizes, "comm_s_per_sample": comm,
              "allreduce_s": allreduce, "rounds": cfg.rounds, "compile": cfg.compile}
    if verify:
        result.update(verify_sweep(predictions, chosen, _timer(t, cfg.rounds)))
        result["sweep_best_label"] = label(result["sweep_best"])
    dist.barrier()
    return result
