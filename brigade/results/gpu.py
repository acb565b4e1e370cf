"""What one GPU shows about the main model: step time, bf16 MFU and peak memory.

    python -m brigade.results.gpu [--steps 30] [--out results/gpu]

Trains the main job's GPT (the defaults of `brigade train`) in this process on cuda:0 with
bf16 autocast, and reports the median step time, tokens per second, model FLOPs utilisation
against the device's dense bf16 peak, and the allocator's peak memory. MFU counts
6 · parameters + 12 · layers · context · width FLOPs per token (forward and backward,
attention included), as the PaLM paper does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
from torch import nn

from brigade.errors import BrigadeError
from brigade.launcher import groups

# Dense bf16 tensor-core peaks, FLOP/s (vendors' data sheets); BRIGADE_PEAK_TFLOPS overrides.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12,
             "A10": 125e12, "4090": 165e12, "V100": 125e12}


def peak_flops(name: str) -> float | None:
    """The device's dense bf16 peak in FLOP/s, or None when unknown."""
    if os.environ.get("BRIGADE_PEAK_TFLOPS"):
        return float(os.environ["BRIGADE_PEAK_TFLOPS"]) * 1e12
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def flops_per_token(n_params: int, n_layer: int, context: int, n_embd: int) -> float:
    """Training FLOPs per token: matmuls with the weights (6N) plus attention scores."""
    return 6 * n_params + 12 * n_layer * context * n_embd


def measure(steps: int) -> dict:
    """Train the main job's model on cuda:0 for `steps` steps; returns the figures."""
    from brigade.config import RunConfig
    from brigade.train.data import build
    from brigade.train.trainer import Trainer

    cfg = RunConfig()
    cfg.parallel.nproc, cfg.parallel.dp, cfg.train.max_steps = 1, 1, steps
    cfg.train.eval_every, cfg.train.out = steps + 1, ""
    blocks, loss_fn, train, val, *_ = build(cfg)
    trainer = Trainer(blocks, loss_fn, train, None, parallel=cfg.parallel, optim=cfg.optim,
                      train=cfg.train, metrics=False)
    torch.cuda.reset_peak_memory_stats()
    records = trainer.fit()
    trainer.close()
    groups.destroy()  # the Trainer joined a group of one; leave it before exit, as NCCL asks
    times = [r["step_time_s"] for r in records if "step_time_s" in r][3:]  # past warm-up
    step = statistics.median(times)
    m = cfg.model
    n_params = sum(p.numel() for p in nn.ModuleList(blocks).parameters())  # a tied weight once
    tokens = cfg.train.batch_size * cfg.data.block_size
    achieved = flops_per_token(n_params, m.n_layer, cfg.data.block_size, m.n_embd) * tokens / step
    name = torch.cuda.get_device_name(0)
    peak = peak_flops(name)
    return {"device": name, "steps": steps, "median_step_s": step, "tokens_per_s": tokens / step,
            "params": n_params, "achieved_tflops": achieved / 1e12,
            "mfu_bf16": achieved / peak if peak else None,
            "peak_allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
            "peak_reserved_mib": torch.cuda.max_memory_reserved() / 2**20,
            "final_loss": next(r["loss"] for r in reversed(records) if "loss" in r)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="results/gpu")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit(f"brigade.results.gpu: error: {BrigadeError('no GPU is visible')}: "
                         "run it on a machine with CUDA")
    result = measure(args.steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(result, indent=2))
    mfu = f"{100 * result['mfu_bf16']:.1f} %" if result["mfu_bf16"] else "unknown peak"
    print(f"{result['device']}: {1e3 * result['median_step_s']:.1f} ms per step, "
          f"{result['tokens_per_s']:.0f} tokens/s, bf16 MFU {mfu}, "
          f"peak allocated {result['peak_allocated_mib']:.0f} MiB; wrote {out / 'gpu.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
