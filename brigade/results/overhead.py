"""The whole `brigade train` loop against a raw torch DDP loop on the same model and batch.

    python -m brigade.results.overhead --out results/overhead

brigade's side is `brigade train` itself, run as a user runs it (a subprocess, default
GPT 4 × 128, context 128, global batch 32, dp = 2 on 2 processes of one thread): every step
of its loop counts — the stop-flag all-reduce, metrics, the hang watchdog, callbacks, DDP's
comm hook. Its step time is the gap between consecutive step records in metrics.jsonl.
The raw side is what one writes by hand from the DDP tutorial, on the same blocks
(`brigade.train.data.build`), data, AdamW and clipping, timed at the same point of each step.
Rounds alternate between the two so that drift in the machine's speed falls on both alike;
the first `--warmup` steps of every round are left out. Both loops run on the backend and
device brigade train picks (the raw loop's model, batches and DDP on `DistInfo.device`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from brigade.config import RunConfig, to_toml
from brigade.config.optimizer import flags, resolve
from brigade.data.sampler import Sampler
from brigade.errors import BrigadeError, RunError
from brigade.launcher import agent, groups
from brigade.measure.device import ddp
from brigade.train.data import build
from brigade.train.metrics import loop_seconds, read_records


def raw_worker(cfg: RunConfig) -> list[float]:
    """The tutorial's DDP loop; returns rank 0's wall clock after every step."""
    info = groups.init(cfg.parallel.backend, threads=cfg.parallel.threads)
    stamps = _raw_loop(cfg, info)  # its DDP model is gone before the group (groups.destroy)
    groups.destroy()
    return stamps


def _raw_loop(cfg: RunConfig, info) -> list[float]:
    world, device = info.world_size, info.device
    blocks, loss_fn, train, *_ = build(cfg)
    model = ddp(torch.nn.Sequential(*blocks), device)
    o = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2),
                            weight_decay=o.weight_decay, **flags(resolve(o.adamw, device.type)))
    sampler = Sampler(len(train), cfg.train.batch_size, cfg.train.seed)
    stamps = []
    dist.barrier()
    for _ in range(cfg.train.max_steps):
        x, y = train.batch(Sampler.shard(sampler.next_global(), info.rank, world))
        x, y = x.to(device), y.to(device)
        loss = loss_fn(model(x), y)
        loss.backward()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss.detach())  # the loss every rank reports, as brigade does
        float(loss.detach())  # the loss reaches the host, as brigade's metrics need it
        stamps.append(time.time())
    return stamps


def bench_config(steps: int, warmup: int, tiny: bool) -> RunConfig:
    """The main job's configuration, long enough for one round; `tiny` for tests."""
    cfg = RunConfig()
    cfg.train.max_steps = warmup + steps + 1
    cfg.train.snapshot_every = 0  # a snapshot is not part of a step; its cost is measured apart
    cfg.train.eval_every = cfg.train.max_steps  # evaluation only before and after the timed steps
    cfg.train.sample_tokens = 0
    if tiny:
        cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head = 2, 32, 2
        cfg.model.context = cfg.data.block_size = 32
        cfg.train.batch_size, cfg.train.eval_batches = 8, 1
    return cfg


def brigade_round(cfg: RunConfig, warmup: int, folder: Path) -> float:
    """Mean seconds per step of `brigade train --config` in a fresh folder.

    Raises:
        RunError: the training run failed (its last output line).
    """
    folder.mkdir(parents=True)
    (folder / "run.toml").write_text(to_toml(cfg))
    out = folder / "run"
    done = subprocess.run([sys.executable, "-m", "brigade", "train", "--config", str(folder / "run.toml"),
                           "--out", str(out)], capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise RunError(f"brigade train failed in the overhead bench (exit {done.returncode}): {tail}")
    return statistics.mean(loop_seconds(read_records(out), skip=warmup))


def raw_round(cfg: RunConfig, warmup: int) -> float:
    """Mean seconds per step of the raw DDP loop, timed like brigade's."""
    stamps = agent.launch(raw_worker, cfg.parallel.nproc, cfg)[0]
    gaps = [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1:])]
    return statistics.mean(gaps)


def measure_overhead(steps: int, rounds: int, warmup: int, tiny: bool = False) -> dict:
    """Alternating rounds of both loops; returns the per-round means, medians and the overhead."""
    cfg = bench_config(steps, warmup, tiny)
    raw, ours = [], []
    with tempfile.TemporaryDirectory(prefix="brigade-overhead-") as tmp:
        for k in range(rounds):
            raw.append(raw_round(cfg, warmup))
            ours.append(brigade_round(cfg, warmup, Path(tmp) / f"round{k}"))
    r, b = statistics.median(raw), statistics.median(ours)
    return {"config": cfg.to_dict(), "steps": steps, "rounds": rounds, "warmup": warmup,
            "raw_step_s": raw, "brigade_step_s": ours, "raw_median_s": r, "brigade_median_s": b,
            "overhead": b / r - 1}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/overhead")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out at the start of a round")
    parser.add_argument("--tiny", action="store_true", help="a tiny GPT, to test this script")
    args = parser.parse_args(argv)
    try:
        result = measure_overhead(args.steps, args.rounds, args.warmup, args.tiny)
    except BrigadeError as exc:
        print(f"brigade overhead: error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(result, indent=2))
    raw, ours = result["raw_median_s"], result["brigade_median_s"]
    print(f"raw DDP loop {raw * 1e3:.1f} ms/step, brigade train {ours * 1e3:.1f} ms/step: "
          f"overhead {100 * result['overhead']:+.1f} % (median of {args.rounds} rounds × {args.steps} steps)")
    print(f"wrote {out / 'overhead.json'}")


if __name__ == "__main__":
    main()
