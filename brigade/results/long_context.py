"""What `brigade plan` predicts for Llama 3.1 8B at long sequences on H100s, context parallel among
the layouts: the best layout, the best without cp and the best pipeline without cp, each with its
tokens/s per GPU, memory per GPU by kind and whether it fits 80 GB.

    python -m brigade.results.long_context --out results/plan      (about two minutes: shapes only)

Each case is `brigade plan --model hf:DIR` on a directory holding only the model's config.json
(`big_plans`' Llama 3.1 8B), bf16 (FSDP2's mixed precision where sharded), `--costs formula`, ring
attention (`--cp-method auto` on a GPU), recompute none, selective or full, the 1F1B and
interleaved schedules, at sequence 32,768, 65,536 and 131,072 on 8 and 16 H100s (one and two
nodes), with as many sequences a step as keep 131,072 tokens a GPU (a batch of 32, 16 and 8 on 8
GPUs). The markdown table (long_context.md) is written from the JSON.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from brigade.results import script
from brigade.results.big_plans import LLAMA31, SIZES, TINY

SEQUENCES, GPUS, TOKENS_PER_GPU = (32768, 65536, 131072), (8, 16), 131072
TINY_SEQUENCES, TINY_GPUS, TINY_TOKENS = (64, 128), (8,), 128
CASE = {"recompute": "none,selective,full", "schedules": "1f1b,interleaved"}
TINY_CASE = {"recompute": "none,full", "schedules": "1f1b"}
KINDS = ("params", "grads", "optimizer", "activations", "split", "peak")
GIB = 2**30
CHOICES = ("best", "best_without_cp", "best_pipeline_without_cp")


def summary(row: dict | None, gpus: int) -> dict | None:
    """One ranked row as the JSON keeps it: its layout, times and memory per GPU by kind (GiB)."""
    if row is None:
        return None
    return {"label": row["label"], "layout": row["layout"], "step_s": row["step_s"],
            "tokens_per_s_per_gpu": row["tokens_per_s"] / gpus, "mfu": row["mfu"],
            "context_s": row["context_s"], "reduce_s": row["reduce_s"], "bubble": row["bubble"],
            "memory_gib": {k: row["memory"][k] / GIB for k in KINDS}, "fits": row["fits"]}


def plan_case(config: dict, seq: int, gpus: int, tokens: int, case: dict, where: Path) -> dict:
    """One case: `planner.run.plan` of the config-only directory `where` holding `config`; the
    best row, the best at cp 1, and the best pipeline (pp > 1) at cp 1."""
    from brigade.planner.config import PlanConfig
    from brigade.planner.run import plan

    (where / "config.json").write_text(json.dumps(config, indent=1))
    batch = gpus * tokens // seq
    cfg = PlanConfig(model=f"hf:{where}", nodes=max(1, gpus // 8), gpus_per_node=min(gpus, 8), device="h100",
                     seq_len=seq, batch_size=batch, precision="bf16", costs="formula", **case)
    planned = plan(cfg)
    rows = planned["rows"]
    whole = [r for r in rows if r["layout"]["cp"] == 1]
    picked = (rows[0], next(iter(whole), None), next((r for r in whole if r["layout"]["pp"] > 1), None))
    out = {"seq_len": seq, "gpus": gpus, "batch_size": batch, "cluster": planned["cluster"],
           "cp_method": planned["cp_method"], "layouts": len(rows),
           "cp_layouts": len(rows) - len(whole), "fitting": sum(r["fits"] for r in rows),
           "fitting_without_cp": sum(r["fits"] for r in whole)}
    return {**out, **{name: summary(r, gpus) for name, r in zip(CHOICES, picked)}}


def result_of(tiny: bool) -> dict:
    """Every case's JSON (module docstring)."""
    name = "tiny" if tiny else "8B"
    config = {**LLAMA31, **(TINY if tiny else SIZES)[name]}
    sequences, gpus, tokens = (TINY_SEQUENCES, TINY_GPUS, TINY_TOKENS) if tiny else (SEQUENCES, GPUS,
                                                                                       TOKENS_PER_GPU)
    case = TINY_CASE if tiny else CASE
    with tempfile.TemporaryDirectory(prefix="brigade-long-") as tmp:
        cases = [plan_case(config, seq, n, tokens, case, Path(tmp)) for n in gpus for seq in sequences]
    return {"model": f"Llama 3.1 {name}", "precision": "bf16", "device": "h100", "tokens_per_gpu": tokens,
            **case, "cases": cases, "config": config,
            "command": "python -m brigade.results.long_context" + (" --tiny" if tiny else "")}


def _cell(row: dict | None) -> list[str]:
    """A choice's cells: its layout, tokens/s per GPU, peak GiB per GPU and whether it fits."""
    if row is None:
        return ["none", "", "", ""]
    return [row["label"], f"{row['tokens_per_s_per_gpu']:,.0f}", f"{row['memory_gib']['peak']:.1f}",
            "yes" if row["fits"] else "no"]


def markdown(result: dict) -> str:
    """The table docs/plan.md quotes: per case, each of the three choices (`CHOICES`)."""
    head = ["GPUs", "sequence", "batch"]
    for name in ("best layout", "best without cp", "best pipeline without cp"):
        head += [name, "tokens/s/GPU", "peak GiB", "fits"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in result["cases"]:
        cells = [str(c["gpus"]), f"{c['seq_len']:,}", str(c["batch_size"])]
        cells += [cell for name in CHOICES for cell in _cell(c[name])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Per case, tokens/s per GPU of the three choices (bars; hatched: does not fit 80 GB)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["cases"]
    fig, ax = plt.subplots(figsize=(11, 5))
    for k, (name, color) in enumerate(zip(CHOICES, ("#4c72b0", "#dd8452", "#55a868"))):
        for i, c in enumerate(cases):
            row = c[name]
            if row is not None:
                ax.bar(i + (k - 1) * 0.27, row["tokens_per_s_per_gpu"], 0.25, color=color,
                       hatch="" if row["fits"] else "//", label=name.replace("_", " ") if i == 0 else None)
    names = [f"{c['gpus']} GPUs\nsequence {c['seq_len']:,}" for c in cases]
    ax.set_xticks(range(len(cases)), names, fontsize=7)
    ax.set_ylabel("tokens/s per GPU (predicted)")
    ax.set_title(f"brigade plan: {result['model']} on H100s, bf16, {result['tokens_per_gpu']:,} tokens a GPU "
                 "a step (hatched: does not fit 80 GB)", fontsize=9)
    ax.legend(fontsize=8)
    script.close(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = script.parser("python -m brigade.results.long_context", __doc__, "results/plan",
                      "long_context.json, .png and .md", "a tiny Llama, tests the script, not the planner")
    args = p.parse_args(argv)
    result = result_of(args.tiny)
    for c in result["cases"]:
        b, w = c["best"], c["best_without_cp"]
        print(f"{c['gpus']:>3} H100, sequence {c['seq_len']:>7,}: best {b['label']:<50} "
              f"{b['tokens_per_s_per_gpu']:7.0f} tokens/s/GPU, peak {b['memory_gib']['peak']:5.1f} GiB; "
              f"without cp {w['label'] if w else 'none'}", flush=True)
    script.save(result, args.out, "long_context", plot)
    (Path(args.out) / "long_context.md").write_text(markdown(result), encoding="utf-8")
    print(f"wrote {Path(args.out) / 'long_context.md'}")
    return 0


if __name__ == "__main__":
    script.run(main, "brigade.results.long_context")
