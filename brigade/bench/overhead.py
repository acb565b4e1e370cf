"""The trainer's overhead against a raw torch DDP loop on the same model and batch.

    python -m brigade.bench.overhead --out results/overhead

Both run the built-in GPT (4 layers, width 128, context 128, global batch 32) with
dp = 2 on 2 processes of one thread, AdamW, gradient clipping at 1.0. The raw loop is
what one writes by hand from the DDP tutorial. Rounds alternate between the two so
that drift in the machine's speed falls on both alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from brigade import dist as bdist
from brigade.config import OptimConfig, ParallelConfig, TrainConfig
from brigade.models.gpt import GPTConfig, gpt, gpt_loss
from brigade.train.data import Sampler, load_text_data
from brigade.train.trainer import Trainer


def worker(steps: int, rounds: int) -> dict:
    info = bdist.init(threads=1)
    vocab, train, _ = load_text_data("", 128, 0.1)
    cfg = GPTConfig(len(vocab), 128, 4, 4, 128, 0.0)
    torch.manual_seed(0)
    trainer = Trainer(gpt(cfg), gpt_loss, train, None, parallel=ParallelConfig(nproc=2),
                      optim=OptimConfig(), train=TrainConfig(max_steps=10**6, batch_size=32),
                      metrics=False)
    torch.manual_seed(0)
    raw_model = DDP(torch.nn.Sequential(*gpt(cfg)))
    raw_opt = torch.optim.AdamW(raw_model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)
    sampler = Sampler(len(train), 32, 0)

    def raw_step():
        idx = Sampler.shard(sampler.next_global(), info.rank, 2)
        x, y = train.batch(idx)
        loss = gpt_loss(raw_model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(raw_model.parameters(), 1.0)
        raw_opt.step()
        raw_opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss.detach())  # the loss every rank reports, as the trainer does

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        dist.barrier()
        return (time.perf_counter() - start) / steps

    timed(raw_step), timed(trainer.train_step)  # warm-up
    raw, ours = [], []
    for _ in range(rounds):
        raw.append(timed(raw_step))
        ours.append(timed(trainer.train_step))
    trainer.close()
    bdist.destroy()
    return {"raw_step_s": raw, "brigade_step_s": ours}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="results/overhead")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    r = bdist.launch(worker, 2, args.steps, args.rounds)[0]
    raw, ours = statistics.median(r["raw_step_s"]), statistics.median(r["brigade_step_s"])
    result = {**r, "raw_median_s": raw, "brigade_median_s": ours, "overhead": ours / raw - 1}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(result, indent=2))
    print(f"raw DDP loop {raw * 1e3:.1f} ms/step, brigade Trainer {ours * 1e3:.1f} ms/step: "
          f"overhead {100 * (ours / raw - 1):+.1f} % (median of {args.rounds} rounds × {args.steps} steps)")
    print(f"wrote {out / 'overhead.json'}")


if __name__ == "__main__":
    main()
