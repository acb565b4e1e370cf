"""The tutorial's experiment, per configuration, on 2 devices (2 processes, one thread each).

    single           rank 0 alone runs the whole model on the whole batch
    model parallel   2 stages, no micro-batching (m = 1)
    pipelined        GPipe, 1F1B and zero-bubble over a sweep of split sizes
    torch            torch.distributed.pipelining, same stages and micro-batches
    ddp              DistributedDataParallel over the same 2 devices, half the batch each

Every configuration: warm-up, then `repeats` timed steps (all ranks start together; a step
lasts until the slowest rank is done). Ideal pipelined step: `simulate()` on each stage's
measured per-micro-batch costs; efficiency = ideal / measured. Models, batches and every
collective's tensors live on the process's device (`DistInfo.device`); clocks are read after
synchronising it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from brigade import groups
from brigade.bench.memory import stage_meter
from brigade.bench.peers import TORCH_SCHEDULES, TorchPipelining
from brigade.bench.place import ddp, place_model
from brigade.bench.timing import (
    Workload,
    gathered_stage_costs,
    measure,
    pipeline_step,
    time_pipeline,
    time_single,
    train_step,
)
from brigade.models import load_model
from brigade.pipeline.partition import choose_balance, split
from brigade.pipeline.pipe import Pipeline
from brigade.pipeline.plan import simulate
from brigade.pipeline.schedule import build, names

TUTORIAL_SPLITS = [1, 3, 5, 8, 10, 12, 20, 40, 60]  # of a batch of 120


@dataclass
class BenchConfig(Workload):
    splits: list[int] = field(default_factory=list)  # split sizes; empty: the tutorial's, scaled
    schedules: list[str] = field(default_factory=names)
    balance: list[int] | None = None


def scaled_splits(batch: int) -> list[int]:
    """The tutorial's split sizes for 120 images, scaled to `batch`: for each, the divisor of
    `batch` nearest to it (so every micro-batch has the same size, which torch's pipelining needs)."""
    divisors = [d for d in range(1, batch + 1) if batch % d == 0]
    out = []
    for s in TUTORIAL_SPLITS:
        target = s * batch / 120
        size = min(divisors, key=lambda d: (abs(math.log(d / target)), d))
        if size not in out and size < batch:
            out.append(size)
    return out


def _row(name: str, schedule: str | None, m: int, batch: int, timing, **extra) -> dict:
    return {"name": name, "schedule": schedule, "stages": extra.pop("stages", 2), "microbatches": m,
            "split_size": math.ceil(batch / m), "mean_s": timing.mean_s, "std_s": timing.std_s,
            "samples_s": timing.samples, **extra}


def _pipelined(cfg, spec, stages, x, y, rank, schedule, m, trace=False):
    """Time brigade's pipeline; also its ideal (simulate), memory peak and one traced step.

    `stages` and the batch are on the process's device (x.device)."""
    n, device = len(stages), x.device
    fwd, bwd, wgt = gathered_stage_costs(stages, rank, x, y, spec.loss_fn, m, repeats=3)
    ideal = simulate(build(schedule, n, m), fwd, bwd, weight=wgt).makespan
    mine = stages[rank]
    pipe = Pipeline(mine, schedule, m, spec.loss_fn, device=device)
    timing = time_pipeline(pipe, mine, x, y, cfg)
    meter = stage_meter(device, exclude=list(mine.parameters()))
    with meter:
        pipeline_step(pipe, mine, x, y)()
    peaks = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(n)]
    dist.all_gather(peaks, torch.tensor([float(meter.peak_bytes)], dtype=torch.float64, device=device))
    traced = None
    if trace:
        dist.barrier()
        pipe.step(x, y, trace=True)
        mine.zero_grad(set_to_none=True)
        t0 = torch.tensor([min(s for _, s, _ in pipe.last_result.trace)], dtype=torch.float64,
                          device=device)
        dist.all_reduce(t0, op=dist.ReduceOp.MIN)  # perf_counter is system-wide on Linux
        events = [(str(a), s - t0.item(), e - t0.item()) for a, s, e in pipe.last_result.trace]
        gathered: list = [None] * n
        dist.all_gather_object(gathered, events)
        traced = gathered
    extra = {"ideal_s": ideal, "stage_forward_s": fwd, "stage_backward_s": bwd, "stage_weight_s": wgt,
             "peak_activation_bytes": [p.item() for p in peaks], "memory_method": meter.method}
    return timing, extra, traced


def _single(cfg, spec, x, y, rank):
    """The whole model on rank 0's device, whole batch; its timing, known to every rank."""
    single = time_single(spec.blocks, spec.loss_fn, x, y, cfg) if rank == 0 else None
    dist.barrier()
    timing = [single]
    dist.broadcast_object_list(timing, src=0)
    return timing[0]


def _ddp(cfg, spec, x, y, rank, n):
    """DDP over the n processes, each on its device with 1/n of the batch."""
    wrapped = ddp(nn.Sequential(*copy.deepcopy(spec.blocks)), x.device)
    xs, ys = x.chunk(n)[rank], y.chunk(n)[rank]
    return measure(train_step(wrapped, spec.loss_fn, xs, ys), cfg.repeats, cfg.warmup, device=x.device,
                   distributed=True)


def worker(cfg: BenchConfig) -> dict:
    info = groups.init(cfg.backend, threads=1)
    rank, n, device = info.rank, info.world_size, info.device
    spec = load_model(cfg.model, seed=cfg.seed, **cfg.model_options)
    x, y = place_model(spec, cfg.batch_size, cfg.seed, device)
    # Cut where measured time balances (both systems then run the same stages); rank 0 decides.
    balance = choose_balance(spec.blocks, n, by="time", sample=x[: max(1, cfg.batch_size // 2)],
                             balance=cfg.balance)
    agreed = [balance]
    dist.broadcast_object_list(agreed, src=0)
    balance = agreed[0]
    rows = [_row("single", None, 1, cfg.batch_size, _single(cfg, spec, x, y, rank), stages=1)]
    timing, extra, _ = _pipelined(cfg, spec, split(copy.deepcopy(spec.blocks), balance), x, y, rank,
                                  "gpipe", 1)
    rows.append(_row("model parallel", "gpipe", 1, cfg.batch_size, timing, balance=balance, **extra))
    best_trace, best_time = None, math.inf
    for schedule in cfg.schedules:
        for size in cfg.splits or scaled_splits(cfg.batch_size):
            m = math.ceil(cfg.batch_size / size)
            stages = split(copy.deepcopy(spec.blocks), balance)
            timing, extra, traced = _pipelined(cfg, spec, stages, x, y, rank, schedule, m, trace=True)
            rows.append(_row("brigade", schedule, m, cfg.batch_size, timing, balance=balance, **extra))
            if timing.mean_s < best_time:
                best_time = timing.mean_s
                best_trace = {"schedule": schedule, "microbatches": m, "events": traced}
            if schedule in TORCH_SCHEDULES and cfg.batch_size % m == 0:  # torch needs equal chunks
                peer = TorchPipelining(stages[rank], rank, n, schedule, m, spec.loss_fn, info.device)
                t = time_pipeline(peer, peer.module, x, y, cfg)
                rows.append(_row("torch.distributed.pipelining", schedule, m, cfg.batch_size, t,
                                 balance=balance, torch_pipelining=True, ideal_s=extra["ideal_s"]))
    rows.append(_row("ddp", None, 1, cfg.batch_size, _ddp(cfg, spec, x, y, rank, n), stages=1))
    groups.destroy()
    return {"rows": rows, "trace": best_trace, "balance": balance,
            "memory_method": rows[1]["memory_method"]}


def summarise(cfg: BenchConfig, raw: dict, device: str) -> dict:
    """Add speedups, ideal speedups and efficiencies; mark the peers."""
    single = raw["rows"][0]["mean_s"]
    configs = []
    for r in raw["rows"]:
        row = {k: v for k, v in r.items() if k != "samples_s"}
        row["torch_pipelining"] = bool(r.get("torch_pipelining"))
        row["speedup_vs_single"] = single / r["mean_s"]
        ideal = r.get("ideal_s")
        row["ideal_speedup"] = single / ideal if ideal else (1.0 if r["name"] == "single" else None)
        row["efficiency"] = ideal / r["mean_s"] if ideal else None
        configs.append(row)
    return {"config": asdict(cfg), "device": device, "balance": raw["balance"], "configs": configs,
            "timeline": raw["trace"], "memory_method": raw["memory_method"]}
