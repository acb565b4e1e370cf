"""Pipeline step time on 2 CPU processes: single device vs brigade vs torch.distributed.pipelining.

    python -m brigade.bench.speed --out results/speed        # MLP 8 × Linear(1024), batch 256

Each process is one "device" with one thread (or its GPU, under NCCL: everything is placed
on `DistInfo.device`). The ideal pipelined step is the makespan `simulate()` gives from each
stage's measured per-micro-batch forward and backward costs; efficiency = ideal step time ÷
measured step time.
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from brigade import agent, groups
from brigade.bench.peers import TORCH_SCHEDULES, TorchPipelining, nearest_torch_schedule
from brigade.bench.place import place_model
from brigade.bench.timing import Workload, gathered_stage_costs, time_pipeline, time_single
from brigade.models import load_model
from brigade.pipeline.partition import choose_balance, split
from brigade.pipeline.pipe import Pipeline
from brigade.pipeline.plan import simulate
from brigade.pipeline.schedule import DEFAULT, build, help_text


@dataclass
class SpeedConfig(Workload):
    model: str = "mlp"
    batch_size: int = 256
    repeats: int = 10
    warmup: int = 3
    stages: int = 2
    cases: list[tuple[str, int]] = field(default_factory=lambda: [(DEFAULT, 2)])


def worker(cfg: SpeedConfig) -> dict:
    info = groups.init(cfg.backend, threads=1)
    rank, device = info.rank, info.device
    spec = load_model(cfg.model, seed=cfg.seed, **cfg.model_options)
    x, y = place_model(spec, cfg.batch_size, cfg.seed, device)
    balance = choose_balance(spec.blocks, cfg.stages)
    single = asdict(time_single(spec.blocks, spec.loss_fn, x, y, cfg)) if rank == 0 else {}
    dist.barrier()
    rows = []
    for schedule, m in cfg.cases:
        stages = split(copy.deepcopy(spec.blocks), balance)
        fwd, bwd, wgt = gathered_stage_costs(stages, rank, x, y, spec.loss_fn, m)
        ideal = simulate(build(schedule, cfg.stages, m), fwd, bwd, weight=wgt).makespan
        mine = stages[rank]
        ours = time_pipeline(Pipeline(mine, schedule, m, spec.loss_fn, device=device), mine, x, y, cfg)
        peer_schedule = nearest_torch_schedule(schedule)
        peer = TorchPipelining({rank: copy.deepcopy(mine)}, cfg.stages, peer_schedule, m, spec.loss_fn,
                               device)
        theirs = time_pipeline(peer, peer.module, x, y, cfg)
        rows.append({"schedule": schedule, "microbatches": m, "balance": balance,
                     "stage_forward_s": fwd, "stage_backward_s": bwd, "stage_weight_s": wgt,
                     "ideal_s": ideal,
                     "brigade": asdict(ours), "torch_pipelining": asdict(theirs),
                     "torch_schedule": peer_schedule, "torch_class": TORCH_SCHEDULES[peer_schedule].cls})
    groups.destroy()
    return {"single": single, "rows": rows}


def summarise(cfg: SpeedConfig, raw: dict) -> dict:
    single = raw["single"]["mean_s"]
    out = {"config": asdict(cfg), "single_mean_s": single, "single_std_s": raw["single"]["std_s"],
           "cases": []}
    for r in raw["rows"]:
        ours, theirs = r["brigade"]["mean_s"], r["torch_pipelining"]["mean_s"]
        out["cases"].append({
            **{k: r[k] for k in ("schedule", "microbatches", "balance", "stage_forward_s",
                                 "stage_backward_s", "stage_weight_s", "torch_schedule", "torch_class")},
            "brigade_mean_s": ours, "brigade_std_s": r["brigade"]["std_s"],
            "torch_pipelining_mean_s": theirs, "torch_pipelining_std_s": r["torch_pipelining"]["std_s"],
            "ideal_s": r["ideal_s"],
            "speedup_vs_single": single / ours,
            "ideal_speedup": single / r["ideal_s"],
            "efficiency": r["ideal_s"] / ours,
            "vs_torch_pipelining": theirs / ours,
        })
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/speed")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--microbatches", default="2", help="comma-separated m values")
    parser.add_argument("--schedule", default=DEFAULT, help=help_text())
    args = parser.parse_args(argv)
    cases = [(args.schedule, int(m)) for m in args.microbatches.split(",")]
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"  # NCCL: one GPU per process
    cfg = SpeedConfig(cases=cases, repeats=args.repeats, backend=backend)
    result = summarise(cfg, agent.launch(worker, cfg.stages, cfg)[0])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speed.json").write_text(json.dumps(result, indent=2))
    print(f"single device: {result['single_mean_s'] * 1e3:.1f} ms")
    for c in result["cases"]:
        print(f"{c['schedule']} m={c['microbatches']}: brigade {c['brigade_mean_s'] * 1e3:.1f} ms "
              f"(×{c['speedup_vs_single']:.2f} vs single, efficiency {c['efficiency']:.2f}), "
              f"torch.distributed.pipelining ({c['torch_class']}) "
              f"{c['torch_pipelining_mean_s'] * 1e3:.1f} ms "
              f"→ brigade ×{c['vs_torch_pipelining']:.2f}")
    print(f"wrote {out / 'speed.json'}")


if __name__ == "__main__":
    main()
