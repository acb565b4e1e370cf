"""What `brigade plan` predicts for Llama 3.1 8B, 70B and 405B on H100 clusters, from config.json
alone (no weights: `--costs formula`), in the layouts the field runs them in: memory per GPU by
kind, whether it fits 80 GB, tokens/s per GPU; beside the public figure where one is known.

    python -m brigade.results.big_plans --out results/plan      (about a minute: shapes only)

Each case is `brigade plan --model hf:DIR` on a directory holding only the model's config.json
(the architecture's published hyperparameters, written here), bf16 (FSDP2's mixed precision),
sequence 8192. The public figures are torchtitan's measured peaks on H100s (96 GB): the 8B on 8
GPUs as its performance page states it (FSDP, local batch 2, selective recompute, eager), on 128
GPUs 15.4 GiB less (as the issue that asked for this quotes the drop from 8 to 128), the
70B (FSDP 32 × TP 8 on 256 GPUs, local batch 16 in one forward and backward) as the issue that
asked for this quotes it (about 72 GiB).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from brigade.results import script

LLAMA31 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
           "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
           "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
           "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
SIZES = {"8B": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                    num_hidden_layers=32),
         "70B": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                     num_hidden_layers=80),
         "405B": dict(hidden_size=16384, intermediate_size=53248, num_attention_heads=128,
                      num_key_value_heads=8, num_hidden_layers=126)}
# (model, nodes of 8 GPUs, global batch, recompute, shard, tp, pp, schedule, micro-batches, public GiB)
CASES = [
    ("8B", 1, 16, "selective", 8, 1, 1, "1f1b", 1, 82.4),  # torchtitan's: local batch 2 in one pass
    ("8B", 1, 16, "selective", 8, 1, 1, "1f1b", 2, None),  # the same as 2 micro-batches of one
    ("8B", 16, 256, "selective", 128, 1, 1, "1f1b", 1, 67.0),  # torchtitan's 82.4 less the 15.4 quoted
    ("70B", 32, 512, "full", 32, 8, 1, "1f1b", 1, 72.0),  # torchtitan's: local batch 16 in one pass
    ("70B", 32, 512, "full", 32, 8, 1, "1f1b", 16, None),  # the same as 16 micro-batches of one
    ("405B", 64, 256, "full", 8, 8, 8, "1f1b", 32, None),
    ("405B", 64, 256, "full", 8, 8, 8, "interleaved", 32, None),
]
TINY = {"tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=2, vocab_size=256)}
TINY_CASES = [("tiny", 1, 8, "full", 2, 2, 2, "1f1b", 4, None)]


def plan_case(case: tuple, sizes: dict, where: Path, seq_len: int) -> dict:
    """One case's top row (`planner.run.plan`) on a config-only directory under `where`."""
    from brigade.planner.config import PlanConfig
    from brigade.planner.run import plan

    model, nodes, batch, mode, shard, tp, pp, schedule, m, public = case
    d = where / model
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**LLAMA31, **sizes[model]}, indent=1))
    cfg = PlanConfig(model=f"hf:{d}", nodes=nodes, gpus_per_node=8, device="h100", seq_len=seq_len,
                     batch_size=batch, precision="bf16", costs="formula", recompute=mode, shard=shard,
                     tp=tp, pp=pp, schedules=schedule, microbatches=str(m))
    (row,) = plan(cfg)["rows"][:1]
    gpus = nodes * 8
    return {"model": f"Llama 3.1 {model}", "gpus": gpus, "label": row["label"], "batch": batch,
            "memory": row["memory"], "fits": row["fits"], "tokens_per_s_per_gpu": row["tokens_per_s"] / gpus,
            "mfu": row["mfu"], "public_peak_gib": public}


def plot(result: dict, path: Path) -> None:
    """Per case, the busiest rank's memory by kind stacked, its peak, and the public figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ("params", "grads", "optimizer", "activations")
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(10, 5))
    for i, r in enumerate(rows):
        bottom = 0.0
        for kind, color in zip(kinds, ("#4c72b0", "#dd8452", "#55a868", "#c44e52")):
            gib = r["memory"][kind] / 2**30
            ax.bar(i, gib, 0.6, bottom=bottom, color=color, label=kind if i == 0 else None)
            bottom += gib
        ax.plot([i - 0.3, i + 0.3], [r["memory"]["peak"] / 2**30] * 2, color="black",
                label="peak" if i == 0 else None)
        if r["public_peak_gib"]:
            ax.plot(i, r["public_peak_gib"], "k*", label="public (torchtitan)" if i == 0 else None)
    ax.axhline(80e9 / 2**30, color="gray", lw=1, ls="--", label="80 GB")
    names = [f"{r['model']}, {r['gpus']} GPUs\n" + r["label"].replace(", ", "\n") for r in rows]
    ax.set_xticks(range(len(rows)), names, fontsize=6)
    ax.set_ylabel("GiB per GPU (busiest rank)")
    ax.set_title("brigade plan, bf16, sequence 8192: bars, the states and activations; up to the peak, the "
                 "gathered weights, the gradients a step holds whole, temporaries", fontsize=8)
    ax.legend(fontsize=8)
    script.close(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = script.parser("python -m brigade.results.big_plans", __doc__, "results/plan",
                      "big_plans.json and big_plans.png", "a tiny Llama, tests the script, not the planner")
    args = p.parse_args(argv)
    sizes, cases, seq = (TINY, TINY_CASES, 32) if args.tiny else (SIZES, CASES, 8192)
    with tempfile.TemporaryDirectory(prefix="brigade-big-") as tmp:
        rows = [plan_case(c, sizes, Path(tmp), seq) for c in cases]
    for r in rows:
        fits = "yes" if r["fits"] else "no"
        print(f"{r['model']:>16} on {r['gpus']:>3} H100  {r['label']:<48} peak "
              f"{r['memory']['peak'] / 2**30:6.1f} GiB  fits 80 GB: {fits}", flush=True)
    result = {"seq_len": seq, "precision": "bf16", "rows": rows,
              "command": "python -m brigade.results.big_plans" + (" --tiny" if args.tiny else "")}
    script.save(result, args.out, "big_plans", plot)
    return 0


if __name__ == "__main__":
    script.run(main, "brigade.results.big_plans")
