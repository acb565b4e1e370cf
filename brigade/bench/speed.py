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
from torch import nn

from brigade import dist as bdist
from brigade.bench.peers import TorchPipelining
from brigade.bench.place import place_model
from brigade.bench.timing import gathered_stage_costs, measure
from brigade.models import load_model
from brigade.pipeline.partition import choose_balance, split
from brigade.pipeline.pipe import Pipeline
from brigade.pipeline.schedule import build, simulate


@dataclass
class SpeedConfig:
    model: str = "mlp"
    model_options: dict = field(default_factory=dict)
    batch_size: int = 256
    stages: int = 2
    cases: list[tuple[str, int]] = field(default_factory=lambda: [("1f1b", 2)])
    repeats: int = 10
    warmup: int = 3
    seed: int = 0
    backend: str = "auto"


def worker(cfg: SpeedConfig) -> dict:
    info = bdist.init(cfg.backend, threads=1)
    rank, device = info.rank, info.device
    spec = load_model(cfg.model, seed=cfg.seed, **cfg.model_options)
    x, y = place_model(spec, cfg.batch_size, cfg.seed, device)
    balance = choose_balance(spec.blocks, cfg.stages)
    single = {}
    if rank == 0:
        full = nn.Sequential(*copy.deepcopy(spec.blocks))

        def single_step():
            spec.loss_fn(full(x), y).backward()
            full.zero_grad(set_to_none=True)

        single = asdict(measure(single_step, cfg.repeats, cfg.warmup, device=device))
    dist.barrier()
    rows = []
    for schedule, m in cfg.cases:
        stages = split(copy.deepcopy(spec.blocks), balance)
        fwd, bwd, wgt = gathered_stage_costs(stages, rank, x, y, spec.loss_fn, m)
        ideal = simulate(build(schedule, cfg.stages, m), fwd, bwd, weight=wgt).makespan
        mine = stages[rank]
        pipe = Pipeline(mine, schedule, m, spec.loss_fn, device=device)

        def brigade_step(pipe=pipe, mine=mine):
            pipe.step(x, y)
            mine.zero_grad(set_to_none=True)

        ours = measure(brigade_step, cfg.repeats, cfg.warmup, device=device, distributed=True)
        peer_schedule = schedule if schedule in ("gpipe", "1f1b") else "1f1b"
        peer = TorchPipelining(copy.deepcopy(mine), rank, cfg.stages, peer_schedule, m, spec.loss_fn,
                               device)
        theirs = measure(lambda peer=peer: peer.step(x, y), cfg.repeats, cfg.warmup, device=device,
                         distributed=True)
        rows.append({"schedule": schedule, "microbatches": m, "balance": balance,
                     "stage_forward_s": fwd, "stage_backward_s": bwd, "stage_weight_s": wgt,
                     "ideal_s": ideal,
                     "brigade": asdict(ours), "torch_pipelining": asdict(theirs),
                     "torch_schedule": peer_schedule})
    bdist.destroy()
    return {"single": single, "rows": rows}


def summarise(cfg: SpeedConfig, raw: dict) -> dict:
    single = raw["single"]["mean_s"]
    out = {"config": asdict(cfg), "single_mean_s": single, "single_std_s": raw["single"]["std_s"],
           "cases": []}
    for r in raw["rows"]:
        ours, theirs = r["brigade"]["mean_s"], r["torch_pipelining"]["mean_s"]
        out["cases"].append({
            **{k: r[k] for k in ("schedule", "microbatches", "balance", "stage_forward_s",
                                 "stage_backward_s", "stage_weight_s", "torch_schedule")},
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
    parser.add_argument("--schedule", default="1f1b")
    args = parser.parse_args(argv)
    cases = [(args.schedule, int(m)) for m in args.microbatches.split(",")]
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"  # NCCL: one GPU per process
    cfg = SpeedConfig(cases=cases, repeats=args.repeats, backend=backend)
    result = summarise(cfg, bdist.launch(worker, cfg.stages, cfg)[0])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speed.json").write_text(json.dumps(result, indent=2))
    print(f"single device: {result['single_mean_s'] * 1e3:.1f} ms")
    for c in result["cases"]:
        print(f"{c['schedule']} m={c['microbatches']}: brigade {c['brigade_mean_s'] * 1e3:.1f} ms "
              f"(×{c['speedup_vs_single']:.2f} vs single, efficiency {c['efficiency']:.2f}), "
              f"torch.distributed.pipelining ({c['torch_schedule']}) "
              f"{c['torch_pipelining_mean_s'] * 1e3:.1f} ms "
              f"→ brigade ×{c['vs_torch_pipelining']:.2f}")
    print(f"wrote {out / 'speed.json'}")


if __name__ == "__main__":
    main()
