"""The memory rows of the results table (docs/results.md): what results/footprint/ and results/plan/
hold, and the speed levers' results/levers/, each rendered with the page's rounding (`rows.Row`).
The last rows of the table, in this order."""

from __future__ import annotations

from brigade.results.rows import Row, adder

ROWS: list[Row] = []  # in the order of the figure functions below
row = adder(ROWS)

_FOOTPRINT = ("footprint/footprint.json", "`python -m brigade.results.footprint`")
_MIB = 2 ** 20


def _largest(run: dict, *kinds: str) -> float:
    """MiB of `kinds` together on the rank that holds the most of them."""
    return max(sum(r[k] for k in kinds) for r in run["ranks"]) / _MIB


@row("memory per rank, GPT 4×256, context 64, batch 8, 4 processes: parameters + gradients + "
     "AdamW state (largest rank), peak, step time; no recompute", *_FOOTPRINT)
def _footprint_layouts(d: dict) -> str:
    apart = {t["against"] for t in d["targets"].get("sequence", [])}  # the sequence row's own runs
    apart |= {t["layout"] for t in d["targets"].get("sequence", [])}
    runs = [r for r in d["runs"] if r["recompute"] == "none" and r["layout"] not in apart]
    within = all(t["within"] for t in d["targets"]["states"])
    parts = [f"{r['layout']} {_largest(r, 'params', 'grads', 'optimizer'):.1f} MiB, peak "
             f"{_largest(r, 'peak'):.1f} MiB, {r['step_s'] * 1e3:.0f} ms" for r in runs]
    return "; ".join(parts) + (f" — every sharded rank within 1/S of DDP's plus one block's states: "
                               f"{'yes' if within else 'NO'}")


@row("activation recompute (none / full / selective): activations held (largest rank) and step time",
     *_FOOTPRINT)
def _footprint_recompute(d: dict) -> str:
    parts = []
    for layout in dict.fromkeys(r["layout"] for r in d["runs"] if r["recompute"] != "none"):
        modes = {r["recompute"]: r for r in d["runs"] if r["layout"] == layout}
        parts.append(f"{layout}: " + " / ".join(f"{_largest(modes[m], 'activations'):.2f} MiB "
                                                f"{modes[m]['step_s'] * 1e3:.0f} ms"
                                                for m in ("none", "full", "selective")))
    a = d["targets"]["activations_full"]
    bound = (f"full recompute, {a['microbatches_in_flight']} micro-batches in flight: "
             f"{a['held_peak'] / _MIB:.2f} MiB held ≤ {a['bound'] / _MIB:.2f} MiB (their block inputs + "
             f"one block's working set): {'yes' if a['within'] else 'NO'}")
    return "; ".join(parts) + "; " + bound


@row("tensor parallel at equal world size (4 processes, no recompute): the largest rank's parameters + "
     "gradients + AdamW state, activations, peak and step time, against the same layout without tp",
     *_FOOTPRINT)
def _footprint_tensor(d: dict) -> str:
    return "; ".join(_held_against(t, ratio="states") for t in d["targets"]["tensor"])


def _held_against(t: dict, ratio: str, places: int = 2) -> str:
    """One layout against another (`footprint.tensor_comparison`): states, activations, peak and
    step, each beside the other's; the ratio shown for the figure `ratio` names, to `places`."""
    def pair(name: str, digits: int) -> str:
        shown = f" (×{t[name + '_ratio']:.{places}f})" if name == ratio else ""
        return f"{t[name] / _MIB:.{digits}f} vs {t[name + '_against'] / _MIB:.{digits}f} MiB{shown}"

    return (f"{t['layout']} vs {t['against']}: states {pair('states', 1)}, activations "
            f"{pair('activations', 2)}, peak {pair('peak', 1)}, step {t['step_s'] * 1e3:.0f} vs "
            f"{t['step_s_against'] * 1e3:.0f} ms")


@row("bf16 under sharding (FSDP2's mixed precision; 4 processes, no recompute): the largest rank's states, "
     "activations, peak and step time, against the same layout in fp32", *_FOOTPRINT)
def _footprint_precision(d: dict) -> str:
    return "; ".join(_held_against(t, ratio="activations") for t in d["targets"]["precision"])


@row("sequence parallel: tp 2 × pp 2 (4 processes) against pp 2 (2 processes) on the same replica batch, "
     "4 micro-batches, no recompute: the largest rank's states, activations (target: ≤ 0.56 of tp 1's "
     "with sequence parallel), peak and step time", *_FOOTPRINT)
def _footprint_sequence(d: dict) -> str:
    # three places: the target is 0.56
    return "; ".join(_held_against(t, ratio="activations", places=3) for t in d["targets"]["sequence"])


@row("split backward (one stage of 4 GPT blocks, batch 8): forward, input pass I, weight pass W",
     *_FOOTPRINT)
def _footprint_split(d: dict) -> str:
    return "; ".join(f"{mode}: F {s['forward_ms']:.1f} ms, I {s['input_ms']:.1f} ms, W {s['weight_ms']:.1f} "
                     f"ms, forwards run again per block {s['recomputes_per_block']:.0f}"
                     for mode, s in d["split_backward"].items())


@row("brigade plan of Llama 3.1 from config.json alone, H100 80 GB, sequence 8192, bf16: the busiest "
     "rank's parameters + gradients + AdamW state, activations and peak, whether it fits; the public "
     "figure beside it where known", "plan/big_plans.json", "`python -m brigade.results.big_plans`")
def _big_plans(d: dict) -> str:
    parts = []
    for r in d["rows"]:
        m = {k: v / 2**30 for k, v in r["memory"].items()}
        public = f" (torchtitan {r['public_peak_gib']:.1f} GiB)" if r["public_peak_gib"] else ""
        states, fits = m["params"] + m["grads"] + m["optimizer"], "yes" if r["fits"] else "no"
        parts.append(f"{r['model']} on {r['gpus']}, {r['label']}: states {states:.1f}, activations "
                     f"{m['activations']:.1f}, peak {m['peak']:.1f} GiB{public}, fits: {fits}")
    return "; ".join(parts)


@row("brigade plan held against torchtitan's Llama 3.1 H100 benchmark (end of 2024), every row planned from "
     "config alone: tokens/s per GPU and reserved GiB, planned vs published, and the rows within 15 %",
     "plan/published_vs_planned.json", "`python -m brigade.results.published`")
def _published(d: dict) -> str:
    parts = [f"T{r['table']} {r['model']} {r['label']} on {r['gpus']}: {r['planned_tokens_per_s_per_gpu']:,.0f} vs "
             f"{r['published_tokens_per_s_per_gpu']:,} tokens/s/GPU ({r['tokens_error']:+.0%}), "
             f"{r['planned_reserved_gib']:.1f} vs {r['published_gib']} GiB ({r['memory_error']:+.0%})"
             for r in d["rows"]]
    within = sum(abs(r["tokens_error"]) <= d["goal"] and abs(r["memory_error"]) <= d["goal"] for r in d["rows"])
    return f"{within} of {len(d['rows'])} rows within 15 % on both; " + "; ".join(parts)


@row("brigade plan of Qwen3-30B-A3B from config.json alone, 2 nodes of 8 H100, sequence 4096, bf16: "
     "parameters in all and active a token, the best layout at each ep, its tokens/s per GPU, all-to-all "
     "seconds a step and peak", "plan/moe_plan.json", "`python -m brigade.results.moe_plan`")
def _moe_plan(d: dict) -> str:
    p = d["parameters"]
    parts = [f"ep {r['layout']['ep']}: {r['label']}, {r['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
             f"all-to-all {r['all_to_all_s']:.2f} s, peak {r['memory_gib']['peak']:.1f} GiB"
             for r in d["by_ep"]]
    return f"{p['total'] / 1e9:.2f} B parameters, {p['active'] / 1e9:.2f} B active; " + "; ".join(parts)


@row("brigade plan of Llama 3.1 8B from config.json alone at sequence 32,768, 65,536 and 131,072 on 8 "
     "and 16 H100s, bf16, ring attention: the best layout (context parallel among them), the best without "
     "cp and the best pipeline without cp, their tokens/s per GPU and peak", "plan/long_context.json",
     "`python -m brigade.results.long_context`")
def _long_context(d: dict) -> str:
    def one(r: dict) -> str:
        return (f"{r['label']} {r['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
                f"{r['memory_gib']['peak']:.1f} GiB")

    return "; ".join(f"{c['gpus']} GPUs at {c['seq_len']:,}: {one(c['best'])} (without cp: "
                     f"{one(c['best_without_cp'])}; pipeline: {one(c['best_pipeline_without_cp'])})"
                     for c in d["cases"])


@row("a mixture-of-experts GPT (4×256, 8 experts, top 2; 4 processes on 2 cores) at ep 1, 2, 4, "
     "replicated and sharded: the busiest rank's peak and the step, measured and as brigade plan predicts "
     "them; and a tiny Qwen3-MoE's fine-tune over pp 2 × ep 2: the worst layer's busiest expert ÷ the "
     "mean one, first and last step", "experts/experts.json", "`python -m brigade.results.experts`")
def _experts(d: dict) -> str:
    parts = [f"{r['label']}: peak {max(r['measured_peak']) / _MIB:.1f} MiB (predicted "
             f"{100 * r['memory_error']:+.1f} %), step {r['measured_step_s'] * 1e3:.0f} ms (predicted "
             f"{r['predicted_step_s'] * 1e3:.0f})" for r in d["rows"]]
    tune = d["finetune"]
    first, last = tune["moe_imbalance"][0], tune["moe_imbalance"][-1]
    return "; ".join(parts) + (f"; fine-tune imbalance {first:.2f} → {last:.2f}, validation loss "
                               f"{tune['val_loss'][0]:.2f} → {tune['val_loss'][1]:.2f}")


@row("the GPT (2×64, 4 heads, a batch of 2) under context parallel (all-to-all) on this machine: each "
     "rank's activations at sequence 1024 at cp 1, 2, 4, and the longest sequence whose every rank's "
     "measured peak stays within 64 MiB", "context/context.json", "`python -m brigade.results.context`")
def _context(d: dict) -> str:
    at = "; ".join(f"cp {r['cp']}: activations {r['activations'] / _MIB:.2f} MiB ({r['ratio']:.3f} of cp 1)"
                   for r in d["at_1024"])
    far = ", ".join(f"cp {r['cp']} {r['longest']:,}" for r in d["longest"])
    return f"{at}; the longest sequence within {d['limit'] / _MIB:.0f} MiB: {far}"


@row("brigade plan against brigade train on this machine: GPT 4×256 (context 64, batch 16), the MLP and "
     "examples/llama.py; dp, shard, HSDP, pp (1f1b, interleaved V = 2, zb, zbv, auto), dp × pp, tp 2 × pp 2 "
     "(sequence parallel), tp 2 × shard 2, shard 2 in bf16; recompute none and full",
     "plan/accuracy.json", "`python -m brigade.results.plan_accuracy`")
def _plan_accuracy(d: dict) -> str:
    s = d["summary"]
    return (f"{s['layouts']} layouts: step time median error {100 * s['median_step_error']:.1f} %, worst "
            f"{100 * s['worst_step_error']:.1f} %; per-rank peak memory median "
            f"{100 * s['median_memory_error']:.1f} %, worst {100 * s['worst_memory_error']:.1f} %")


@row("the GPU speed levers on this CPU, GPT 4×256 (context 64, batch 16), one process: step time off ÷ on "
     "(> 1: faster on); and examples/llama.py for 200 steps under bf16, bf16 + compile and float8: the "
     "spread of their final validation losses; zb's input and weight passes of a stage, eager and compiled",
     "levers/levers.json", "`python -m brigade.results.levers`")
def _levers(d: dict) -> str:
    speed = "; ".join(f"{r['lever']} ×{r['speedup']:.2f}" for r in d["speed"])
    losses = ", ".join(f"{name} {c['val_loss']:.3f}" for name, c in d["curves"]["settings"].items())
    split = "; ".join(f"{k}: I {v['input_ms']:.1f} ms, W {v['weight_ms']:.1f} ms"
                      for k, v in d["split_backward"].items())
    return (f"{speed}; split backward {split}; final validation loss {losses}: spread "
            f"{100 * d['curves']['final_spread']:.1f} %")


@row("the head's loss, plain against chunked (`--chunked-loss`): peak resident memory of its forward and "
     "backward on the CPU, vocabulary 128 256, sequence 4096, one sample, hidden size 1024, fp32",
     "head-loss/head_loss.json", "`python -m brigade.results.head_loss`")
def _head_loss(d: dict) -> str:
    plain, *chunked = d["rows"]
    each = "; ".join(f"chunks of {r['chunk']}: {r['peak_bytes']:,} bytes (×{r['ratio']:.2f}), "
                     f"{r['seconds']:.0f} s" for r in chunked)
    return (f"plain {plain['peak_bytes']:,} bytes, {plain['seconds']:.0f} s; {each}; losses within "
            f"{d['max_abs_loss_diff']:.0e}")


@row("LoRA rank 8 against full fine-tuning: the tiny Llama widened (4 layers, width 128) on chats from "
     "pydoc's topics, 2 processes (DDP), 60 steps, the same seed; the exports reloaded",
     "lora/lora.json", "`python -m brigade.results.lora`")
def _lora(d: dict) -> str:
    runs = {r["mode"]: r for r in d["runs"]}
    each = "; ".join(f"{name}: {r['trainable']:,} trainable, optimizer "
                     f"{max(r['optimizer_bytes']) / _MIB:.2f} MiB and peak {max(r['peak_bytes']) / _MIB:.1f} "
                     f"MiB a rank, {r['step_s'] * 1e3:.0f} ms a step, held-out loss {r['held_out_loss']:.3f}"
                     for name, r in (("full", runs["full"]), ("LoRA", runs["lora"])))
    return (f"{each}; the merged export in transformers and the adapter in peft score within "
            f"{d['reloaded_delta']:.0e} of brigade eval")
