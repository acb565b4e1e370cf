"""What `brigade plan` predicts for Qwen3-30B-A3B, a mixture of experts, on 2 nodes of 8 H100s from
its config.json alone (no weights: `--costs formula`): every layout ranked, expert parallel among
them, memory per GPU by kind, tokens/s, and the parameters in all against those a token runs through.

    python -m brigade.results.moe_plan --out results/plan      (about half a minute: shapes only)

The case is `brigade plan --model hf:DIR` on a directory holding only the model's published
config.json (written here), bf16 (FSDP2's mixed precision where sharded), sequence 4096, a global
batch of 128 sequences (524,288 tokens), recompute none, selective or full, and the 1F1B and
interleaved pipeline schedules (pp 1 to 16). Every MoE layer has 128 experts, 8 a token: ep is
tried at 1, 2, 4, 8 and 16 wherever it divides dp.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from brigade.results import script

QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                 "num_experts_per_tok": 8, "norm_topk_prob": True, "vocab_size": 151936,
                 "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
                 "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "hidden_act": "silu", "torch_dtype": "bfloat16"}
TINY = {**QWEN3_30B_A3B, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 256}
NODES, PER_NODE = 2, 8
CASE = {"seq_len": 4096, "batch_size": 128, "recompute": "none,selective,full",
        "schedules": "1f1b,interleaved"}
TINY_CASE = {"seq_len": 32, "batch_size": 16, "recompute": "none,full", "schedules": "1f1b"}
KINDS = ("params", "grads", "optimizer", "activations", "split", "peak")
GIB = 2**30
TOP = 20  # the ranked rows kept in the JSON


def summary(row: dict) -> dict:
    """One ranked row as the JSON keeps it: its layout, times and memory per GPU by kind (GiB)."""
    per_gpu = row["tokens_per_s"] / (NODES * PER_NODE)
    return {"label": row["label"], "layout": row["layout"], "step_s": row["step_s"],
            "tokens_per_s": row["tokens_per_s"], "tokens_per_s_per_gpu": per_gpu,
            "mfu": row["mfu"], "all_to_all_s": row["all_to_all_s"], "reduce_s": row["reduce_s"],
            "bubble": row["bubble"], "memory_gib": {k: row["memory"][k] / GIB for k in KINDS},
            "fits": row["fits"]}


def plan_qwen(config: dict, case: dict, where: Path) -> dict:
    """`planner.run.plan` of the config-only directory `where` holding `config`, on 2 × 8 H100."""
    from brigade.planner.config import PlanConfig
    from brigade.planner.run import plan

    (where / "config.json").write_text(json.dumps(config, indent=1))
    cfg = PlanConfig(model=f"hf:{where}", nodes=NODES, gpus_per_node=PER_NODE, device="h100",
                     precision="bf16", costs="formula", **case)
    return plan(cfg)


def result_of(planned: dict, config: dict, case: dict, tiny: bool) -> dict:
    """The JSON: the ranked layouts, the best at each ep, the best one's memory by kind, and the
    config.json planned (as published, not as transformers expands it)."""
    rows = planned["rows"]
    by_ep: dict[int, dict] = {}
    for r in rows:  # ranked: the first of each ep is its best
        by_ep.setdefault(r["layout"]["ep"], r)
    best = summary(rows[0])
    return {"model": "Qwen3-30B-A3B" + (" (tiny)" if tiny else ""), "cluster": planned["cluster"],
            "gpus": NODES * PER_NODE, "precision": "bf16", "source": planned["source"], **case,
            "tokens_per_step": case["batch_size"] * case["seq_len"], "parameters": planned["parameters"],
            "layouts": len(rows), "left_out": len(planned["left_out"]), "best": best,
            "by_ep": [summary(by_ep[ep]) for ep in sorted(by_ep)], "rows": [summary(r) for r in rows[:TOP]],
            "config": config,
            "command": "python -m brigade.results.moe_plan" + (" --tiny" if tiny else "")}


def plot(result: dict, path: Path) -> None:
    """At each ep its best layout: tokens/s per GPU (left), memory per GPU by kind (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["by_ep"]
    names = [r["label"].replace(", ", "\n").replace(" × ", " ×\n") for r in rows]
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(13, 5.5))
    speed.bar(range(len(rows)), [r["tokens_per_s_per_gpu"] for r in rows], 0.6, color="#4c72b0")
    speed.set_xticks(range(len(rows)), names, fontsize=6)
    speed.set_ylabel("tokens/s per GPU (predicted)")
    for i, (kind, color) in enumerate(zip(KINDS[:4], ("#4c72b0", "#dd8452", "#55a868", "#c44e52"))):
        bottom = [sum(r["memory_gib"][k] for k in KINDS[:i]) for r in rows]
        memory.bar(range(len(rows)), [r["memory_gib"][kind] for r in rows], 0.6, bottom=bottom, color=color,
                   label=kind)
    for i, r in enumerate(rows):
        memory.plot([i - 0.3, i + 0.3], [r["memory_gib"]["peak"]] * 2, color="black",
                    label="peak" if i == 0 else None)
    memory.axhline(80e9 / GIB, color="gray", lw=1, ls="--", label="80 GB")
    memory.set_xticks(range(len(rows)), names, fontsize=6)
    memory.set_ylabel("GiB per GPU (busiest rank)")
    memory.legend(fontsize=7)
    p = result["parameters"]
    fig.suptitle(f"brigade plan: {result['model']} ({p['total'] / 1e9:.1f} B parameters, "
                 f"{p['active'] / 1e9:.2f} B active) on {result['cluster']}, bf16, sequence "
                 f"{result['seq_len']}, batch {result['batch_size']}: the best layout at each ep", fontsize=9)
    script.close(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = script.parser("python -m brigade.results.moe_plan", __doc__, "results/plan",
                      "moe_plan.json and moe_plan.png", "a tiny Qwen3-MoE, tests the script, not the planner")
    args = p.parse_args(argv)
    config, case = (TINY, TINY_CASE) if args.tiny else (QWEN3_30B_A3B, CASE)
    with tempfile.TemporaryDirectory(prefix="brigade-moe-") as tmp:
        result = result_of(plan_qwen(config, case, Path(tmp)), config, case, args.tiny)
    from brigade.planner.report import parameters

    b = result["best"]
    print(f"{result['model']}, {parameters(result['parameters'])}; {result['layouts']} layouts; best "
          f"{b['label']}: {b['tokens_per_s_per_gpu']:.0f} tokens/s per GPU, peak "
          f"{b['memory_gib']['peak']:.1f} GiB", flush=True)
    for r in result["by_ep"]:
        print(f"  ep {r['layout']['ep']:>2}: {r['label']:<50} {r['tokens_per_s_per_gpu']:7.0f} tokens/s/GPU  "
              f"peak {r['memory_gib']['peak']:5.1f} GiB", flush=True)
    script.save(result, args.out, "moe_plan", plot)
    return 0


if __name__ == "__main__":
    script.run(main, "brigade.results.moe_plan")
