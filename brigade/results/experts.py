"""A mixture-of-experts GPT under expert parallel: measured step time and per-rank peak memory at
ep 1, 2 and 4 on this machine, each beside what `brigade plan` predicts for it.

    python -m brigade.results.experts --out results/experts        (about 15 minutes on 2 cores)
    python -m brigade.results.experts --tiny --rounds 1 --out /tmp/e   (tests this script)

The model: the built-in GPT, 4 blocks of width 256, each block's feed-forward 8 experts (SwiGLUs
of width 512), top 2, sequence 64, a global batch of 16. Every layout is 4 processes (dp 4, so
that ep 4 is possible), replicated (DDP) or sharded (--shard 4), with the experts split over ep
of them: at ep 4 each process holds 2 of each layer's 8 experts, at ep 1 all 8. Four processes
share this machine's 2 cores, which the planner models (`planner.predict`); the step times are
the machine's, not a GPU's.

Each layout is predicted (`planner.predict`, on costs the planner measures here in a process of
its own, as `plan_accuracy` does) and trained for a few steps (`brigade train`). Measured: the
median `step_time_s` after step 2 and each rank's `peak` from the `memory` event (step 2).
Errors are (predicted − measured) ÷ measured, memory's the worst rank's. In rounds (3): every
layout predicted and trained once a round, a row's figures the medians of its rounds'. A
sharded layout's peak moves between runs by about one block's gathered weights (shard 4 at
ep 1: 117.6 MiB in two runs, 130.6 in a third: whether FSDP2 gathers the next block before the
last one's weights are freed), and the router's choices move the expert groups' activations.

And the load balance of a fine-tune (`finetune`): a tiny random Qwen3-MoE directory (4 experts,
top 2, its balancing loss on at 0.01: `output_router_logits`) fine-tuned on brigade's built-in
text with `--nproc 4 --pp 2 --ep 2`, each step's `moe_imbalance` (the busiest expert's choices
over the mean expert's, in the worst layer), `moe_aux` and `moe_entropy` kept.
"""

from __future__ import annotations

from pathlib import Path

from brigade.results import script
from brigade.results.plan_accuracy import _flags, train
from brigade.world.degrees import Degrees

GPT = {"n_layer": 4, "n_embd": 256, "n_head": 4, "seq_len": 64, "batch_size": 16, "experts": 8, "top_k": 2}
GPT_TINY = {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 16, "batch_size": 8, "experts": 4, "top_k": 2}
# (shard, ep): 4 processes each
CASES = [(1, 1), (1, 2), (1, 4), (4, 1), (4, 2), (4, 4)]
TINY_CASES = [(1, 1), (1, 2)]
NPROC = 4


def costs(sizes: dict, shard: int, here):
    """The planner's costs of the MoE GPT at a replica's batch, measured on `here`."""
    from brigade.config import ModelConfig
    from brigade.planner.config import PlanConfig
    from brigade.planner.costs import measure
    from brigade.planner.run import load_spec, model_config
    from brigade.train.memory import quiet_stderr

    cfg = PlanConfig(model="gpt", batch_size=sizes["batch_size"], seq_len=sizes["seq_len"])
    base = ModelConfig(n_layer=sizes["n_layer"], n_head=sizes["n_head"], n_embd=sizes["n_embd"],
                       experts=sizes["experts"], top_k=sizes["top_k"])
    spec = load_spec(cfg, model_config(cfg, base))
    with quiet_stderr():
        return measure(spec, [sizes["batch_size"] // NPROC], ["none"], here, "", shard=shard > 1)


def fresh_costs(sizes: dict, shard: int, here):
    """`costs` in a process of its own (as `plan_accuracy.fresh_costs`, for the same reason)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(costs, sizes, shard, here).result()


def run_case(shard: int, ep: int, sizes: dict, steps: int, where) -> dict:
    """One layout: predicted on costs measured now, then trained."""
    from brigade.planner.predict import predict
    from brigade.planner.space import Layout

    layout = Layout(NPROC // shard, shard, 1, "1f1b", 1, 1, "none", ep=ep)
    row = predict(fresh_costs(sizes, shard, where.device), layout, where, sizes["batch_size"],
                  sizes["seq_len"], "")
    model = _flags({"model": "gpt", "n_layer": sizes["n_layer"], "n_embd": sizes["n_embd"],
                    "n_head": sizes["n_head"], "context": sizes["seq_len"], "block_size": sizes["seq_len"],
                    "batch_size": sizes["batch_size"], "experts": sizes["experts"], "top_k": sizes["top_k"]})
    got = train([*model, *_flags({"nproc": NPROC, "shard": shard, "ep": ep})], steps)
    degrees = Degrees(dp=NPROC, shard=shard, ep=ep)
    predicted = [row["memory_per_stage_rank"][degrees.coords(r).pp]["peak"] for r in range(NPROC)]
    errors = [(p - g) / g for p, g in zip(predicted, got["peak"])]
    return {"shard": shard, "ep": ep, "label": layout.label(),
            "predicted_step_s": row["step_s"], "measured_step_s": got["step_s"],
            "step_error": (row["step_s"] - got["step_s"]) / got["step_s"],
            "predicted_peak": predicted, "measured_peak": got["peak"],
            "memory_error": max(errors, key=abs),
            "predicted_kinds": row["memory_per_stage_rank"][0]}


def finetune(steps: int) -> dict:
    """The load-balance figures of a tiny Qwen3-MoE's fine-tune over pp 2 × ep 2 (module docstring)."""
    import json
    import subprocess
    import sys
    import tempfile

    from brigade.errors import RunError
    from brigade.models.hf import tiny
    from brigade.results.footprint import QUIET

    with tempfile.TemporaryDirectory(prefix="brigade-moe-") as tmp:
        directory = tiny.write(Path(tmp) / "model", "qwen3_moe", layers=2, output_router_logits=True,
                               router_aux_loss_coef=0.01)
        args = ["--model", f"hf:{directory}", "--nproc", "4", "--pp", "2", "--ep", "2", "--schedule", "zb",
                "--block-size", "32", "--batch-size", "8", "--microbatches", "2", "--lr", "3e-3",
                "--warmup-steps", "4", "--eval-every", str(steps), "--max-steps", str(steps)]
        argv = [sys.executable, "-m", "brigade", "train", "--out", f"{tmp}/run", *QUIET, *args]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise RunError(f"the fine-tune: exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in rows if "moe_imbalance" in r]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    return {"command": "brigade train " + " ".join(args), "val_loss": [val[0], val[-1]],
            **{k: [r[k] for r in steps_] for k in ("moe_imbalance", "moe_aux", "moe_entropy")},
            "last_load": steps_[-1]["moe_load"]}


def medians(runs: list[dict]) -> dict:
    """One layout's row from its rounds: each figure the median of its rounds', every round's kept."""
    import statistics

    row = dict(runs[0])
    for key in ("predicted_step_s", "measured_step_s"):
        row[key] = statistics.median(r[key] for r in runs)
    for key in ("predicted_peak", "measured_peak"):
        row[key] = [statistics.median(ranks) for ranks in zip(*(r[key] for r in runs))]
    row["step_error"] = (row["predicted_step_s"] - row["measured_step_s"]) / row["measured_step_s"]
    errors = [(p - g) / g for p, g in zip(row["predicted_peak"], row["measured_peak"])]
    row["memory_error"] = max(errors, key=abs)
    row["rounds"] = [{k: r[k] for k in ("measured_step_s", "measured_peak", "memory_error")} for r in runs]
    return row


def plot(result: dict, path: Path) -> None:
    """Peak memory and step time by layout, measured and predicted, from the JSON alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [r["label"] for r in rows]
    x = range(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    pairs = [([max(r["measured_peak"]) / 2**20 for r in rows],
              [max(r["predicted_peak"]) / 2**20 for r in rows], "peak memory of the busiest rank (MiB)"),
             ([r["measured_step_s"] * 1e3 for r in rows], [r["predicted_step_s"] * 1e3 for r in rows],
              "step time (ms, 4 processes on 2 cores)")]
    tune = result["finetune"]
    axes[2].plot(range(1, len(tune["moe_imbalance"]) + 1), tune["moe_imbalance"], color="#4c72b0")
    axes[2].set_xlabel("step of the Qwen3-MoE fine-tune (pp 2 × ep 2)")
    axes[2].set_ylabel("busiest expert ÷ mean expert (worst layer)")
    for ax, (measured, predicted, what) in zip(axes, pairs):
        ax.bar([i - 0.2 for i in x], measured, 0.4, label="measured", color="#4c72b0")
        ax.bar([i + 0.2 for i in x], predicted, 0.4, label="brigade plan", color="#dd8452")
        ax.set_xticks(list(x), labels, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(what)
        ax.legend(fontsize=8)
    s = result["summary"]
    fig.suptitle(f"MoE GPT ({result['gpt']['experts']} experts, top {result['gpt']['top_k']}) under expert "
                 f"parallel: memory worst {100 * s['worst_memory_error']:+.1f} %, step time median "
                 f"{100 * s['median_step_error']:.1f} %", fontsize=9)
    script.close(fig, path)


def main() -> int:
    import statistics

    from brigade.planner.cluster import Cluster
    from brigade.planner.devices import cpu

    p = script.parser("python -m brigade.results.experts", __doc__, "results/experts",
                      "experts.json and experts.png", "2 layouts of a tiny MoE GPT")
    p.add_argument("--steps", type=int, default=8, help="training steps per layout (≥ 4)")
    p.add_argument("--rounds", type=int, default=3, help="rounds whose medians a row holds (≥ 1)")
    args = p.parse_args()
    sizes, cases = (GPT_TINY, TINY_CASES) if args.tiny else (GPT, CASES)
    where = Cluster(1, NPROC, cpu())
    runs: dict[tuple, list[dict]] = {c: [] for c in cases}
    for k in range(max(args.rounds, 1)):
        for shard, ep in cases:
            runs[(shard, ep)].append(run_case(shard, ep, sizes, max(args.steps, 4), where))
            r = runs[(shard, ep)][-1]
            print(f"round {k + 1}: {r['label']:<24} step {r['measured_step_s'] * 1e3:7.1f} ms (predicted "
                  f"{r['predicted_step_s'] * 1e3:7.1f}); peak {max(r['measured_peak']) / 2**20:7.1f} MiB "
                  f"({100 * r['memory_error']:+.1f} %)", flush=True)
    rows = [medians(runs[c]) for c in cases]
    tuned = finetune(12 if args.tiny else 60)
    print(f"fine-tune: imbalance {tuned['moe_imbalance'][0]:.2f} → {tuned['moe_imbalance'][-1]:.2f}, "
          f"validation loss {tuned['val_loss'][0]:.3f} → {tuned['val_loss'][1]:.3f}", flush=True)
    summary = {"layouts": len(rows),
               "worst_memory_error": max((r["memory_error"] for r in rows), key=abs),
               "median_step_error": statistics.median(abs(r["step_error"]) for r in rows)}
    result = {"gpt": sizes, "nproc": NPROC, "steps": args.steps, "rounds": args.rounds, "rows": rows,
              "summary": summary,
              "finetune": tuned,
              "command": "python -m brigade.results.experts" + (" --tiny" if args.tiny else "")}
    script.save(result, args.out, "experts", plot)
    return 0


if __name__ == "__main__":
    script.run(main, "python -m brigade.results.experts")
