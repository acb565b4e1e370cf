"""Per-rank memory by kind and the step time of the GPT under each data-parallel layout and
recompute mode; and what recompute costs the split backward's two passes.

    python -m brigade.results.footprint --out results/footprint            (about 5 minutes on 2 cores)
    python -m brigade.results.footprint --tiny --steps 3 --out /tmp/m    (tests this script: 7 runs)

Layouts, 4 processes of one thread each: DDP dp 4, shard 4 (FSDP2), shard 2 × pp 2 (parameters
gathered once a step, and with --reshard once a micro-batch), HSDP 2 × 2; each under --recompute
none, full and selective. Tensor parallel at the same world size: tp 2 × pp 2, tp 2 × dp 2 and
tp 2 × shard 2, each held against the layout without tp that has the same pipeline (`TENSOR`);
and on the same replica batch, tp 2 × pp 2 with and without sequence parallel against pp 2 (2
processes), 4 micro-batches each (`SEQUENCE`).
bf16 (FSDP2's mixed precision) on shard 4 and shard 2 × pp 2, against the same layouts in fp32
(`PRECISION`).
Each is `brigade train` as a user runs it: its `memory` event (train/memory.py: parameters,
gradients, optimizer state, activations and peak, per rank, measured on step 2) and the median
step time of the steps after the second. The GPT
is one whose states (16 bytes a parameter under AdamW) outweigh its activations, so sharding
shows. On 2 cores 4 processes share them: step times compare layouts with each other, not with
a machine that has a core per process.

The split backward (I then W, as zb runs it): one stage of transformer blocks in this process,
the input pass and the weight pass timed apart under each recompute mode, with the forwards
each block ran again; recompute happens in I and W reuses it (`parallel.recompute`).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from brigade.config.recompute import MODES
from brigade.errors import BrigadeError, RunError
from brigade.results import script
from brigade.train.memory import KINDS
from brigade.train.metrics import events, read_records, training

LAYOUTS = {"DDP dp 4": ["--nproc", "4"], "shard 4": ["--nproc", "4", "--shard", "4"],
           "DDP dp 2 × pp 2": ["--nproc", "4", "--pp", "2"],
           "shard 2 × pp 2": ["--nproc", "4", "--pp", "2", "--shard", "2"],
           "shard 2 × pp 2, reshard": ["--nproc", "4", "--pp", "2", "--shard", "2", "--reshard"],
           "HSDP 2 × 2": ["--nproc", "4", "--shard", "2"],
           "tp 2 × pp 2": ["--nproc", "4", "--pp", "2", "--tp", "2"],
           "tp 2 × dp 2": ["--nproc", "4", "--tp", "2"],
           "tp 2 × shard 2": ["--nproc", "4", "--tp", "2", "--shard", "2"],
           "shard 4, bf16": ["--nproc", "4", "--shard", "4", "--precision", "bf16"],
           "shard 2 × pp 2, bf16": ["--nproc", "4", "--pp", "2", "--shard", "2", "--precision", "bf16"],
           "pp 2, m 4": ["--nproc", "2", "--pp", "2", "--microbatches", "4"],
           "tp 2 × pp 2, m 4": ["--nproc", "4", "--pp", "2", "--tp", "2", "--microbatches", "4"],
           "tp 2 × pp 2, m 4, no sequence parallel": ["--nproc", "4", "--pp", "2", "--tp", "2",
                                                      "--microbatches", "4", "--no-sequence-parallel"]}
# Each sharded layout, its shard degree and the DDP layout of the same pipeline it is held against.
SHARDED = {"shard 4": (4, "DDP dp 4"), "shard 2 × pp 2": (2, "DDP dp 2 × pp 2"),
           "shard 2 × pp 2, reshard": (2, "DDP dp 2 × pp 2"), "HSDP 2 × 2": (2, "DDP dp 4")}
# Each tensor-parallel layout and the layout of 4 processes without tp it is held against.
TENSOR = {"tp 2 × pp 2": "DDP dp 2 × pp 2", "tp 2 × dp 2": "DDP dp 4", "tp 2 × shard 2": "shard 4"}
# Each bf16 layout (FSDP2's mixed precision) and the same layout in fp32 it is held against.
PRECISION = {"shard 4, bf16": "shard 4", "shard 2 × pp 2, bf16": "shard 2 × pp 2"}
# Tensor parallel on the same replica batch (pp 2, 4 micro-batches; 2 processes against 4), with
# and without sequence parallel: what each rank holds for backward at tp 2 against tp 1.
SEQUENCE = {"tp 2 × pp 2, m 4": "pp 2, m 4", "tp 2 × pp 2, m 4, no sequence parallel": "pp 2, m 4"}
RUNS = [(layout, mode) for layout in LAYOUTS for mode in MODES if mode == "none" or layout in SHARDED]
# `--tiny` tests the script, not brigade: one run of each kind the targets compare (a sharded
# layout under two recompute modes and the DDP layout it is held against, one tp, one bf16 and one
# sequence-parallel pair), 7 runs of 4 processes instead of 22.
TINY_RUNS = [("DDP dp 2 × pp 2", "none"), ("shard 2 × pp 2", "none"), ("shard 2 × pp 2", "full"),
             ("tp 2 × pp 2", "none"), ("shard 2 × pp 2, bf16", "none"), ("pp 2, m 4", "none"),
             ("tp 2 × pp 2, m 4", "none")]
GPT = ["--n-layer", "4", "--n-embd", "256", "--n-head", "4", "--context", "64", "--block-size", "64",
       "--batch-size", "8", "--microbatches", "2"]
TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--context", "32", "--block-size", "32",
        "--batch-size", "8", "--microbatches", "2"]
QUIET = ["--eval-every", "1000", "--eval-batches", "1", "--sample-tokens", "0", "--warmup-steps", "2",
         "--snapshot-every", "0", "--keep", "1"]


def one_run(layout: str, mode: str, model: list[str], steps: int) -> dict:
    """`brigade train` of one configuration: every rank's memory and the median step time."""
    with tempfile.TemporaryDirectory(prefix="brigade-memory-") as tmp:
        argv = [sys.executable, "-m", "brigade", "train", "--out", tmp, *model, *QUIET, *LAYOUTS[layout],
                "--recompute", mode, "--max-steps", str(steps)]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
            raise RunError(f"{layout}, recompute {mode}: exit {done.returncode}: {tail}")
        recs = read_records(Path(tmp))
    (mem,) = events(recs, "memory")
    ranks = sorted({int(k.split("/")[0][4:]) for k in mem if k.startswith("rank")})
    times = [r["step_time_s"] for r in training(recs) if r["step"] > 2]
    return {"layout": layout, "recompute": mode, "counted": mem["counted"],
            "ranks": [{k: mem[f"rank{r}/{k}"] for k in (*KINDS, "peak")} for r in ranks],
            "step_s": statistics.median(times)}


def split_passes(mode: str, tiny: bool, repeats: int) -> dict:
    """Medians over `repeats` of the forward, the input pass and the weight pass of one stage of
    GPT blocks under `mode`, and how many forwards each block ran again in its backward."""
    from brigade.parallel import recompute
    from brigade.pipeline.runtime.backward import backward_split

    blocks, d, t = _gpt_blocks(tiny)
    recompute.apply(blocks, mode)
    stage = nn.Sequential(*blocks)
    times: dict[str, list[float]] = {"forward_ms": [], "input_ms": [], "weight_ms": []}
    for _ in range(repeats + 1):  # the first is a warm-up
        h = torch.randn(8, t, d, requires_grad=True)
        before = recompute.reruns()
        a = time.perf_counter()
        y = stage(h)
        b = time.perf_counter()
        _, weights = backward_split(y.square().mean(), None, h, list(stage.parameters()))
        c = time.perf_counter()
        weights(None)
        e = time.perf_counter()
        for key, s in zip(times, (b - a, c - b, e - c)):
            times[key].append(s * 1e3)
    return {**{k: statistics.median(v[1:]) for k, v in times.items()},
            "recomputes_per_block": (recompute.reruns() - before) / len(blocks)}


def _gpt_blocks(tiny: bool) -> tuple[list[nn.Module], int, int]:
    """The transformer blocks of the benchmark's GPT (no embedding, no head), d and T."""
    from brigade.models.gpt import GPTConfig, gpt

    d, t, layers = (32, 32, 2) if tiny else (256, 64, 4)
    torch.manual_seed(0)
    return gpt(GPTConfig(100, t, n_layer=layers, n_head=2 if tiny else 4, n_embd=d))[1:-1], d, t


def states_target(runs: list[dict], tiny: bool) -> list[dict]:
    """Per sharded run and rank: parameters + gradients + optimizer state against 1/S of what DDP
    of the same pipeline holds on that rank, plus one block's unsharded states (16 bytes a
    parameter under AdamW: its fp32 value, gradient and two moments)."""
    blocks, _, _ = _gpt_blocks(tiny)
    block = 16 * max(sum(p.numel() for p in b.parameters()) for b in blocks)
    at = {(r["layout"], r["recompute"]): r for r in runs}
    out = []
    for (layout, mode), run in at.items():
        if layout not in SHARDED:
            continue
        s, base = SHARDED[layout]
        for rank, (mine, ddp) in enumerate(zip(run["ranks"], at[(base, "none")]["ranks"], strict=True)):
            states, theirs = (sum(r[k] for k in ("params", "grads", "optimizer")) for r in (mine, ddp))
            bound = theirs / s + block
            out.append({"layout": layout, "recompute": mode, "rank": rank, "states": states,
                        "ddp_states": theirs, "shard": s, "one_block_states": block, "bound": bound,
                        "within": states <= bound})
    return out


def tensor_comparison(runs: list[dict], pairs: dict[str, str] = TENSOR) -> list[dict]:
    """Per run of `pairs` (no recompute): its largest rank's states (parameters, gradients,
    optimizer), activations and peak, and its step time, each as a ratio to the same figure of
    the layout it is held against. `TENSOR`: the planned matmuls' states halve under tp 2; the
    embedding, head and norms stay whole, and so do the activations between blocks. `PRECISION`:
    bf16 under FSDP2 keeps the fp32 states and halves the activations. `SEQUENCE`: sequence
    parallel splits the activations between blocks too."""
    at = {(r["layout"], r["recompute"]): r for r in runs}
    out = []
    for layout, base in pairs.items():
        if (layout, "none") not in at:  # `--tiny` runs one pair of each kind
            continue
        mine, theirs = at[(layout, "none")], at[(base, "none")]
        row = {"layout": layout, "against": base}
        for name, kinds in (("states", ("params", "grads", "optimizer")), ("activations", ("activations",)),
                            ("peak", ("peak",))):
            a, b = (max(sum(r[k] for k in kinds) for r in run["ranks"]) for run in (mine, theirs))
            row.update({name: a, f"{name}_against": b, f"{name}_ratio": a / b if b else float("nan")})
        row.update(step_s=mine["step_s"], step_s_against=theirs["step_s"],
                   step_ratio=mine["step_s"] / theirs["step_s"])
        out.append(row)
    return out


def activations_target(tiny: bool, m: int = 4) -> dict:
    """Full recompute on one stage of the GPT's blocks with `m` micro-batches in flight (every
    forward before any backward, as GPipe holds them): the most held for backward, against the
    block inputs of those micro-batches plus one block's working set (what one block holds for
    one micro-batch without recompute)."""
    from brigade.parallel import recompute
    from brigade.parallel.held import Held

    blocks, d, t = _gpt_blocks(tiny)
    x = [torch.randn(2, t, d) for _ in range(m)]
    # Backward from a gradient, as a stage gets it from the next one (a loss would save the output).
    with Held() as one:
        y = blocks[0](x[0].requires_grad_())
        y.backward(torch.ones_like(y))
    recompute.apply(blocks, "full")
    with Held() as held:
        outs = []
        for xi in x:
            h = xi.detach().requires_grad_()
            for b in blocks:
                h = b(h)
            outs.append(h)
        for o in outs:
            o.backward(torch.ones_like(o))
    inputs = m * len(blocks) * x[0].numel() * x[0].element_size()
    return {"microbatches_in_flight": m, "blocks": len(blocks), "block_inputs": inputs,
            "one_block_working_set": one.peak, "bound": inputs + one.peak, "held_peak": held.peak,
            "within": held.peak <= inputs + one.peak}


def plot(result: dict, path: Path) -> None:
    """Per-rank memory stacked by kind, a group of bars per configuration; step times beside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [3, 1]})
    colors = dict(zip(KINDS, ("#4c72b0", "#dd8452", "#55a868", "#c44e52")))
    for i, run in enumerate(runs):
        n = len(run["ranks"])
        for r, rank in enumerate(run["ranks"]):
            x, bottom = i + (r - (n - 1) / 2) * 0.8 / n, 0.0
            for kind in KINDS:
                mib = rank[kind] / 2**20
                left.bar(x, mib, 0.8 / n, bottom=bottom, color=colors[kind],
                         label=kind if i == r == 0 else None)
                bottom += mib
            left.plot([x - 0.4 / n, x + 0.4 / n], [rank["peak"] / 2**20] * 2, color="black", lw=1,
                      label="peak" if i == r == 0 else None)
    names = [f"{run['layout']}, {run['recompute']}" for run in runs]
    left.set_xticks(range(len(runs)), names, fontsize=7, rotation=35, ha="right")
    left.set_ylabel("MiB per rank (one bar per rank)")
    left.set_title("Memory by kind on each rank at step 2; black: the step's peak", fontsize=10)
    fig.suptitle(result["model"], fontsize=8)
    left.legend(fontsize=8)
    right.barh(range(len(runs)), [run["step_s"] * 1e3 for run in runs], color="#8172b3")
    right.set_yticks(range(len(runs)), names, fontsize=7)
    right.invert_yaxis()
    right.set_xlabel("median step time (ms), 4 processes on 2 cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m brigade.results.footprint",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/footprint", help="folder for footprint.json and footprint.png")
    p.add_argument("--steps", type=int, default=8, help="training steps per configuration (≥ 3)")
    p.add_argument("--repeats", type=int, default=10, help="timed repeats of the split backward")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: tests the script, not brigade")
    args = p.parse_args(argv)
    if args.steps < 3:
        raise BrigadeError(f"--steps {args.steps}: need at least 3 (memory is measured on step 2, "
                           "times after it)")
    model = TINY if args.tiny else GPT
    runs = []
    for layout, mode in TINY_RUNS if args.tiny else RUNS:
        runs.append(one_run(layout, mode, model, args.steps))
        print(f"{layout:>24}, recompute {mode:<9}  step {runs[-1]['step_s'] * 1e3:6.1f} ms", flush=True)
    split = {mode: split_passes(mode, args.tiny, args.repeats) for mode in MODES}
    targets = {"states": states_target(runs, args.tiny), "activations_full": activations_target(args.tiny),
               "tensor": tensor_comparison(runs), "precision": tensor_comparison(runs, PRECISION),
               "sequence": tensor_comparison(runs, SEQUENCE)}
    result = {"model": "GPT " + " ".join(model), "steps": args.steps, "runs": runs, "split_backward": split,
              "targets": targets,
              "command": "python -m brigade.results.footprint" + (" --tiny" if args.tiny else "")}
    script.save(result, args.out, "footprint", plot)
    return 0


if __name__ == "__main__":
    script.run(main, "brigade.results.footprint")
