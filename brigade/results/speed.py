"""Pipeline step time on 2 CPU processes: single device vs brigade vs torch.distributed.pipelining.

    python -m brigade.results.speed --out results/speed        # MLP 8 × Linear(1024), batch 256

Each process is one "device" with one thread (or its GPU, under NCCL: everything is placed
on `DistInfo.device`). The ideal pipelined step is the makespan `simulate()` gives from each
stage's measured per-micro-batch forward and backward costs; efficiency = ideal step time ÷
measured step time. Single, brigade and torch are timed in interleaved rounds (`--repeats`
rounds, `timing.interleaved_rounds`), each round's stage costs measured in that round; every
ratio is the median of per-round ratios, with its 95 % CI (`stats.ratio_ci`).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from brigade.bench.peers import TORCH_SCHEDULES, TorchPipelining, nearest_torch_schedule
from brigade.launcher import agent, groups
from brigade.measure.device import place_model
from brigade.measure.stages import gathered_stage_costs
from brigade.measure.stats import median_ci_coverage, ratio_ci
from brigade.measure.timing import Workload, interleaved_rounds, pipeline_step, train_step
from brigade.models import load_model
from brigade.pipeline.pipe import Pipeline
from brigade.pipeline.plans.schedule import DEFAULT, SCHEDULES, build, help_text
from brigade.pipeline.plans.simulate import simulate
from brigade.pipeline.stages.partition import choose_balance, split


@dataclass
class SpeedConfig(Workload):
    model: str = "mlp"
    batch_size: int = 256
    repeats: int = 10
    warmup: int = 3
    stages: int = 2
    cases: list[tuple[str, int]] = field(default_factory=lambda: [(DEFAULT, 2)])


def _single_step(spec, x, y, rank: int):
    """The whole model on rank 0 (whole batch); the other ranks wait in the round's reduce."""
    if rank != 0:
        return lambda: None
    return train_step(nn.Sequential(*copy.deepcopy(spec.blocks)), spec.loss_fn, x, y)


def worker(cfg: SpeedConfig) -> dict:
    """Build single, brigade and torch per case, then time them in interleaved rounds."""
    info = groups.init(cfg.backend, threads=1)
    result = _measure(cfg, info)
    groups.destroy()  # the pipelines are gone first: see there
    return result


def _measure(cfg: SpeedConfig, info) -> dict:
    """The worker's body: everything it builds is freed when this returns."""
    rank, device = info.rank, info.device
    spec = load_model(cfg.model, seed=cfg.seed, **cfg.model_options)
    x, y = place_model(spec, cfg.batch_size, cfg.seed, device)
    balance = choose_balance(spec.blocks, cfg.stages)
    steps, costs = {"single": _single_step(spec, x, y, rank)}, {}
    for schedule, m in cfg.cases:
        stages = split(copy.deepcopy(spec.blocks), balance)
        mine = stages[rank]
        steps[f"brigade|{schedule}|{m}"] = pipeline_step(
            Pipeline(mine, schedule, m, spec.loss_fn, device=device), mine, x, y)
        peer = TorchPipelining({rank: copy.deepcopy(mine)}, cfg.stages, nearest_torch_schedule(schedule), m,
                               spec.loss_fn, device)
        steps[f"torch|{schedule}|{m}"] = pipeline_step(peer, peer.module, x, y)
        got = costs.setdefault(m, [])
        steps[f"probe|{schedule}|{m}"] = lambda stages=stages, m=m, got=got: got.append(
            gathered_stage_costs(stages, rank, x, y, spec.loss_fn, m, repeats=1))
    times = interleaved_rounds(steps, cfg.repeats, cfg.warmup, device, seed=cfg.seed)
    return {"times": times, "balance": balance,
            "costs": {m: got[-cfg.repeats:] for m, got in costs.items()}}  # the warm-up probed too


def _case(schedule: str, m: int, raw: dict) -> dict:
    """One case's figures: medians over rounds and per-round ratios with their 95 % CIs."""
    times, single = raw["times"], raw["times"]["single"]
    ours, theirs = times[f"brigade|{schedule}|{m}"], times[f"torch|{schedule}|{m}"]
    costs = raw["costs"][m][-len(ours):]
    plan = build(schedule, len(raw["balance"]), m)
    ideal = [simulate(plan, f, b, weight=w, input_grad=i).makespan for f, b, w, i in costs]
    peer = nearest_torch_schedule(schedule)
    vs, lo, hi = ratio_ci(theirs, ours)
    n = len(raw["balance"])
    medians = [[statistics.median(c[k][s] for c in costs) for s in range(n)] for k in range(4)]
    return {"schedule": schedule, "microbatches": m, "balance": raw["balance"], "torch_schedule": peer,
            "torch_class": TORCH_SCHEDULES[peer].cls, "stage_forward_s": medians[0],
            "stage_backward_s": medians[1], "stage_weight_s": medians[2], "stage_input_s": medians[3],
            **_spread("brigade", ours), **_spread("torch_pipelining", theirs),
            "ideal_s": statistics.median(ideal), "speedup_vs_single": ratio_ci(single, ours)[0],
            "ideal_speedup": ratio_ci(single, ideal)[0], "efficiency": ratio_ci(ideal, ours)[0],
            "vs_torch_pipelining": vs, "vs_torch_pipelining_ci": [lo, hi],
            "vs_torch_pipelining_ranked": median_ci_coverage(len(ours)) >= 0.95 and not lo <= 1 <= hi}


def _spread(prefix: str, times: list[float]) -> dict:
    """`prefix`_mean_s, _std_s, _median_s and _rounds_s of one configuration's per-round times."""
    std = statistics.stdev(times) if len(times) > 1 else 0.0
    return {f"{prefix}_mean_s": statistics.fmean(times), f"{prefix}_std_s": std,
            f"{prefix}_median_s": statistics.median(times), f"{prefix}_rounds_s": times}


def summarise(cfg: SpeedConfig, raw: dict) -> dict:
    """speed.json: the single device's times and each case's figures (see `_case`)."""
    return {"config": asdict(cfg), **_spread("single", raw["times"]["single"]), "rounds": cfg.repeats,
            "ci_coverage": median_ci_coverage(cfg.repeats),
            "ci_method": "order-statistic CI of the median of per-round ratios, 95 %",
            "cases": [_case(s, m, raw) for s, m in cfg.cases]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/speed")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--microbatches", default="2", help="comma-separated m values")
    parser.add_argument("--schedule", default=DEFAULT, help=help_text())
    args = parser.parse_args(argv)
    single = ", ".join(n for n, s in SCHEDULES.items() if s.virtual == 1)
    if args.schedule not in SCHEDULES:
        parser.error(f"--schedule {args.schedule}: unknown; expected one of {single}")
    if SCHEDULES[args.schedule].virtual != 1:
        bench = f"brigade bench --model mlp --batch-size 256 --splits 128 --schedules {args.schedule}"
        parser.error(f"--schedule {args.schedule}: this bench times one stage per rank ({single}); "
                     f"for several, run `{bench}`")
    cases = [(args.schedule, int(m)) for m in args.microbatches.split(",")]
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"  # NCCL: one GPU per process
    cfg = SpeedConfig(cases=cases, repeats=args.repeats, backend=backend)
    result = summarise(cfg, agent.launch(worker, cfg.stages, cfg)[0])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speed.json").write_text(json.dumps(result, indent=2))
    print(f"single device: {result['single_median_s'] * 1e3:.1f} ms (median of {cfg.repeats} rounds)")
    for c in result["cases"]:
        lo, hi = c["vs_torch_pipelining_ci"]
        rank = "" if c["vs_torch_pipelining_ranked"] else ": cannot rank (the CI holds 1, or under 6 rounds)"
        print(f"{c['schedule']} m={c['microbatches']}: brigade {c['brigade_median_s'] * 1e3:.1f} ms "
              f"(×{c['speedup_vs_single']:.2f} vs single, efficiency {c['efficiency']:.2f}), "
              f"torch.distributed.pipelining ({c['torch_class']}) "
              f"{c['torch_pipelining_median_s'] * 1e3:.1f} ms "
              f"→ brigade ×{c['vs_torch_pipelining']:.2f} (95 % CI {lo:.2f}–{hi:.2f}{rank})")
    print(f"wrote {out / 'speed.json'}")


if __name__ == "__main__":
    main()
