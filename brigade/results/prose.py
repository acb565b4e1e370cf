"""The paragraphs of docs/results.md that say what the figures mean, each written from its files
under results/ (page.py puts them between the page's markers).

Each renderer takes the results folder and returns its paragraph; what it says in words is
fixed, every figure in it comes from a file, so a rerun that changes a figure changes the
paragraph, and one that changes what the words claim (a ranking, a sign) shows in review.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from brigade.results.memory_rows import _largest  # MiB on the rank holding the most, as the table reads it


def load(results: Path, file: str) -> dict:
    return json.loads((results / file).read_text(encoding="utf-8"))


PARAGRAPHS: dict[str, Callable[[Path], str]] = {}


MIB = 2**20
BRIGADE, TORCH = "brigade", "torch.distributed.pipelining"


def _run(fp: dict, layout: str, recompute: str = "none") -> dict:
    return next(r for r in fp["runs"] if r["layout"] == layout and r["recompute"] == recompute)


def _target(fp: dict, group: str, layout: str) -> dict:
    return next(t for t in fp["targets"][group] if t["layout"] == layout)


def _row(d: dict, schedule: str, virtual: int, m: int | None = None, name: str = BRIGADE) -> dict:
    return next(r for r in d["configs"] if r["name"] == name and r["schedule"] == schedule
                and r["virtual"] == virtual and (m is None or r["microbatches"] == m))


def memory(results: Path) -> str:
    fp = load(results, "footprint/footprint.json")
    s4, hsdp = _run(fp, "shard 4"), _run(fp, "HSDP 2 × 2")
    within = "within" if all(t["within"] for t in fp["targets"]["states"]) else "not all within"
    return f"""\
What the memory figures say (`footprint`, GPT 4×256 whose AdamW states outweigh its
activations, 4 processes on 2 cores): sharding divides the states a rank holds by the shard
degree — shard 4 holds a quarter of DDP dp 4's, shard 2 × pp 2 half of DDP dp 2 × pp 2's, HSDP
2 × 2 half of dp 4's — {within} one block's states of the exact 1/S (padding and the optimizer's
step counters), and lowers each rank's peak with them; the all-gathers and reduce-scatters cost
step time here, on two cores shared by four processes. Without a pipeline FSDP gathers and
reduces block by block (shard 4's peak {_largest(s4, 'peak'):.1f} MiB, HSDP 2 × 2's {_largest(hsdp, 'peak'):.1f}). \
Under a pipeline `--reshard`
{_reshard(fp)} Full
recompute holds the fewest activations (each block's input, and one block at a time), selective
keeps the matmul and attention outputs; under the split backward each block's forward runs again
{_recomputes(fp)}, in the input pass, and the weight pass costs what it costs without recompute \
({_weight_ms(fp)})."""


def _reshard(fp: dict) -> str:
    pairs = [(_largest(_run(fp, "shard 2 × pp 2, reshard", m), "peak"), _largest(_run(fp, "shard 2 × pp 2", m), "peak"))
             for m in ("none", "full", "selective")]
    slower = _run(fp, "shard 2 × pp 2, reshard")["step_s"] > _run(fp, "shard 2 × pp 2")["step_s"]
    if all(r >= d - 1e-9 for r, d in pairs) and slower:
        return ("did not lower the peak on this model (the step's peak comes at its end, where every unit's\n"
                "gathered gradients are reduced) and cost time: keep the default unless a forward's gathered\n"
                "parameters are what does not fit.")
    return "lowered the peak in some of these runs: compare the table's rows before choosing it."


def _recomputes(fp: dict) -> str:
    counts = {fp["split_backward"][m]["recomputes_per_block"] for m in ("full", "selective")}
    return "once" if counts == {1.0} else f"{'/'.join(f'{c:g}' for c in sorted(counts))} times"


def _weight_ms(fp: dict) -> str:
    sb = fp["split_backward"]
    return f"{sb['full']['weight_ms']:.1f} and {sb['selective']['weight_ms']:.1f} ms against {sb['none']['weight_ms']:.1f}"


def tensor(results: Path) -> str:
    fp = load(results, "footprint/footprint.json")
    t0, t1, t2 = (_target(fp, "tensor", x) for x in ("tp 2 × pp 2", "tp 2 × dp 2", "tp 2 × shard 2"))
    low = sorted(100 * (1 - t["peak_ratio"]) for t in (t0, t1))
    return f"""\
What the tensor-parallel figures say (`footprint`, the same GPT and 4 processes): tp 2 divides
the states a rank holds against the layout without tp that has the same pipeline (tp 2 × pp 2
{t0['states'] / MIB:.1f} MiB against DDP dp 2 × pp 2's {t0['states_against'] / MIB:.1f}, \
×{t0['states_ratio']:.2f}; tp 2 × dp 2 {t1['states'] / MIB:.1f} against DDP dp 4's \
{t1['states_against'] / MIB:.1f}), since
the embedding and head it keeps whole are small beside the blocks; tp 2 × shard 2 holds what
shard 4 holds (×{t2['states_ratio']:.2f}), the split coming from tp instead of FSDP. Activations \
({t0['activations'] / MIB:.2f} against {t0['activations_against'] / MIB:.2f} MiB; \
{t1['activations'] / MIB:.2f} against {t1['activations_against'] / MIB:.2f}): at the same world \
size a tp layout has half the
replicas, so twice the samples per replica, and sequence parallel halves what each holds. Each
rank's peak is {low[0]:.0f}–{low[1]:.0f} % lower than DDP's. The step is {_slower(t0, t1)} here \
({t0['step_s'] * 1e3:.0f} against {t0['step_s_against'] * 1e3:.0f} ms; {t1['step_s'] * 1e3:.0f}
against {t1['step_s_against'] * 1e3:.0f} ms): on two cores shared by four processes, gloo's \
collectives of every block cost
more than the halved matmuls save — tensor parallel is for fast intra-node links and blocks too
big for one device."""


def _slower(*targets: dict) -> str:
    return "slower" if all(t["step_s"] > t["step_s_against"] for t in targets) else "not slower everywhere"


def bf16(results: Path) -> str:
    fp = load(results, "footprint/footprint.json")
    p0, p1 = (_target(fp, "precision", x) for x in ("shard 4, bf16", "shard 2 × pp 2, bf16"))
    steps = sorted(t["step_ratio"] for t in (p0, p1))
    return f"""\
What the bf16 figures say (`footprint`, the same GPT, 4 processes): under sharding bf16 is FSDP2's
mixed precision, so the states stay the fp32 ones ({p0['states'] / MIB:.1f} MiB on shard 4, \
×{p0['states_ratio']:.2f} of fp32's) while the
activations fall ({p0['activations'] / MIB:.2f} against {p0['activations_against'] / MIB:.2f} MiB, \
×{p0['activations_ratio']:.2f}; shard 2 × pp 2 ×{p1['activations_ratio']:.2f}) and the peak drops \
{100 * (1 - p0['peak_ratio']):.0f} %
on shard 4 and {100 * (1 - p1['peak_ratio']):.0f} % on shard 2 × pp 2, whose stage keeps its \
gathered weights for the step, in
bf16 (without a pipeline only two blocks are gathered at a time). The step is \
{steps[0]:.1f}–{steps[1]:.1f} × slower here: this CPU has no fast bf16 matmul,
and torch runs it through conversions — bf16 is for GPUs, where it is the fast path."""


def experts(results: Path) -> str:
    e = load(results, "experts/experts.json")
    rows, tune = {r["label"]: r for r in e["rows"]}, e["finetune"]
    peak = {label: f"{max(r['measured_peak']) / MIB:.1f}" for label, r in rows.items()}
    worst = max(e["rows"], key=lambda r: abs(r["memory_error"]))
    imbalance, most = tune["moe_imbalance"], max(tune["moe_imbalance"])
    first, last = imbalance.index(most) + 1, len(imbalance) - imbalance[::-1].index(most)
    g = e["gpt"]
    return f"""\
What the mixture-of-experts figures say (`experts`, a GPT {g['n_layer']}×{g['n_embd']} whose blocks \
each hold {g['experts']} experts,
top {g['top_k']}, {e['nproc']} processes on 2 cores, the medians of {e['rounds']} rounds): splitting \
the experts over ep of the {e['nproc']}
replicas divides what each holds of them by ep — the busiest rank's peak falls from \
{peak['dp 4, m 1']} MiB
(DDP, ep 1) to {peak['dp 4, ep 2, m 1']} at ep 2 and {peak['dp 4, ep 4, m 1']} at ep 4, and sharded \
from {peak['shard 4, m 1']} (shard 4) to {peak['shard 4, ep 2, m 1']} and
{peak['shard 4, ep 4, m 1']}, the experts then sharded over what ep leaves. `brigade plan` predicts \
every one of the {len(e['rows'])}
within {_ceil_pct(worst['memory_error'])} % (worst {100 * worst['memory_error']:+.1f} %, \
{worst['label'].removesuffix(', m 1')}). Its step times are less close under DDP with ep
({100 * rows['dp 4, ep 2, m 1']['step_error']:+.0f} % at ep 2, \
{100 * rows['dp 4, ep 4, m 1']['step_error']:+.0f} % at ep 4): here the all-to-alls run over gloo \
among four processes on two
cores, slower than the links the planner models. The fine-tune of a tiny Qwen3-MoE over pp 2 ×
ep 2 shows what the balancing loss is for: by step {first} every token of the worst layer went to one
expert (its busiest over its mean, {most:.1f}, the most top 2 of {len(tune['last_load'][0])} allows) \
and stayed there to about
step {last}; then the balancing loss pulled it back, to {imbalance[-1]:.2f} at step {len(imbalance)}, \
while the validation loss
fell from {tune['val_loss'][0]:.2f} to {tune['val_loss'][-1]:.2f}."""


def _ceil_pct(error: float) -> int:
    """The round bound a worst error sits within: 5 or 10 %, else the next 5 above it."""
    return next(b for b in range(5, 1000, 5) if abs(error) * 100 <= b)


def context(results: Path) -> str:
    c = load(results, "context/context.json")
    at = {r["cp"]: r for r in c["at_1024"]}
    longest = {r["cp"]: r["longest"] for r in c["longest"]}
    g = c["gpt"]
    return f"""\
What the context-parallel figures say (`context`, the GPT {g['n_layer']}×{g['n_embd']} with a batch \
of {g['batch_size']}, `--nproc C --cp C`,
{c['method']}): each rank's activations at sequence {c['seq']} are {at[2]['ratio']:.3f} of one \
device's at cp 2 and
{at[4]['ratio']:.3f} at cp 4, and the longest sequence within {c['limit'] / MIB:.0f} MiB a rank \
grows from {longest[1]:,} (cp 1) to {longest[2]:,}
(cp 2) and {longest[4]:,} (cp 4) — less than C-fold, as the GPT's position table grows with the sequence
on every rank ([context-parallel.md](context-parallel.md#measured-on-this-machine))."""


def resnet(results: Path) -> str:
    from brigade.bench.plot import headline, typical

    d = load(results, "bench/bench.json")
    p = dict(headline(d["configs"]))
    one, ddp = typical(p["Single device"]), typical(p["DDP"])
    ranked = {m: sorted((r for r in d["configs"] if r["name"] == BRIGADE and r["microbatches"] == m),
                        key=lambda r: r["median_s"]) for m in (8, 16)}
    fastest = min(r["median_s"] for rows in ranked.values() for r in rows)
    slower = sum(1 for r in d["configs"] if r["name"] == BRIGADE and r.get("vs_torch") is not None
                 and r["vs_torch"] < 1 and r["vs_torch_ranked"])
    first, second = ranked[8][:2]
    verdict = ("at or above `torch.distributed.pipelining` at every\n(schedule, m) both offer (no row ranked slower)"
               if slower == 0 else f"ranked slower than `torch.distributed.pipelining` at {slower} (schedule, m)")
    return f"""\
What the ResNet-50 figures say: on a CPU, a micro-batch costs far more per image than the full
batch (32 images in one convolution are much cheaper than 8 × 4, and at 4 images the last
blocks, whose weights dominate, cost several times the others), so at m = 8 and 16 \
{'no pipeline is faster' if fastest > one else 'a pipeline is at best a little faster'} than one \
device ({one:.3f} s in this run) and DDP ({ddp:.3f} s) is {'the better' if ddp < min(one, fastest) else 'not the better'} \
use of two cores for this
model. The bench cuts the model for each m where the blocks' times, measured at that m's
micro-batch, balance (`bench.json` "balances": {d['balances']['V1 m8']} at m = 8 for one stage per \
rank). At
m = 8 the fastest of brigade's pipelines is {_pipeline(first)} ({first['median_s']:.3f} s), then \
{_pipeline(second)} ({second['median_s']:.3f} s); at
m = 16 {', then '.join(f"{_pipeline(r)} ({r['median_s']:.3f} s)" for r in ranked[16][:3])}.
Schedule for schedule brigade is {verdict}; see [Known gaps](#known-gaps) below for the
targets it still misses."""


def _pipeline(row: dict) -> str:
    return f"`{row['schedule']}`" + (f" with {row['virtual']} stages per rank" if row["virtual"] > 1 else "")


def same_plan(results: Path) -> str:
    """Auto at V = 2 against DualPipeV on the GPT at pp 2 and pp 4: the resolution of a bench."""
    from brigade.measure.stats import ratio_ci

    parts = []
    for pp, file in ((2, "bench-gpt/bench.json"), (4, "bench-gpt-pp4/bench.json")):
        d = load(results, file)
        auto, dual = _row(d, "auto", 2), _row(d, "dualpipev", 2)
        ratio = ratio_ci(dual["rounds_s"], auto["rounds_s"])[0]
        same = "the same plan" if abs(auto["ideal_s"] - dual["ideal_s"]) < 1e-9 else "not the same plan"
        parts.append((pp, auto["ideal_s"], dual["ideal_s"], same, ratio))
    sims = ", ".join(f"{a:.3f} s at pp {pp}" for pp, a, _, _, _ in parts)
    sames = {s for *_, s, _ in parts}
    return (f"What one plan measures in two rows of one run shows the resolution: auto at V = 2 against\n"
            f"DualPipeV's row on the GPT (auto simulated {sims}; {' and '.join(sorted(sames))} as DualPipeV's "
            f"on the same costs) measured\n" + " and ".join(f"×{r:.3f} of DualPipeV's row at pp {pp}"
                                                       for pp, *_, r in parts) + " (per-round median).")


PARAGRAPHS.update(memory=memory, tensor=tensor, bf16=bf16, experts=experts, context=context, resnet=resnet,
                  **{"same-plan": same_plan})
