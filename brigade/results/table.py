"""The results table of docs/results.md, written from the JSON files in results/ and nothing else.

    python -m brigade.results --table      # prints it; paste it into docs/results.md

Each row names the file that holds its figures; `figure` renders them with the page's
rounding. tests/test_results.py checks that docs/results.md holds exactly this table, so a
figure cannot change on the page without its file, nor the file without the page. The rows of
the runs, speed, benches, faults and tuner are here; those of memory and the planner's accuracy
in `memory_rows`, after them.
"""

from __future__ import annotations

import json
from pathlib import Path

from brigade.bench.plot import headline, typical
from brigade.measure.stats import ratio_ci
from brigade.results import data_rows, fault_rows, memory_rows
from brigade.results.provenance import measured_at
from brigade.results.rows import Row, adder

_OWN: list[Row] = []  # in the order of the figure functions below, which is the table's start
row = adder(_OWN)


@row("main job: GPT 4×128, context 128, batch 32, dp = 2, 1000 steps", "train/main.json", "`brigade train`")
def _main(d: dict) -> str:
    minutes, seconds = divmod(round(d["wall_s"]), 60)
    return (f"validation loss {d['val_loss_first']:.2f} → {d['val_loss_last']:.2f} after {d['steps']} "
            f"steps; the command took {minutes} min {seconds:02d} s")


@row("transparency, tied GPT, every layout of the trainer's tests (dp, pp, local stages, shard, HSDP, tp, "
     "ep, cp, recompute, gradient accumulation, under 1f1b, zb, zbv, interleaved and looped-bfs), 20 steps",
     "check/transparency.json", "`python -m pytest tests/train/test_trainer.py -m ''`")
def _transparency(d: dict) -> str:
    def group(g: dict, against: str) -> str:
        verdict = "all pass" if g["failed"] == 0 and g["passed"] else f"{g['failed']} FAIL"
        return (f"{g['passed'] + g['failed']} cases within {g['tolerance']:g} of {against}, {verdict} "
                f"({', '.join(g['cases'])})")
    return f"per-step losses and gradient norms: fp32 {group(d['fp32'], 'one device')}; " \
           f"bf16 {group(d['bf16'], 'fp32')}"


@row("transparency, GPT, 4 stages, m = 8, process runtime (one process per stage)", "check/check.json",
     "`brigade check --model gpt --stages 4 --microbatches 8`")
def _check(d: dict) -> str:
    return (f"max \\|Δloss\\| {d['max_abs_loss_diff']:.1g}, max \\|Δgrad\\| {d['max_abs_grad_diff']:.1g}, "
            f"max \\|Δparam\\| {d['max_abs_param_diff']:.1g}")


row("same, local runtime (one thread per device)", "check/check-local.json",
    "`brigade check --model gpt --stages 4 --microbatches 8 --runtime local`")(_check)


@row("`brigade train`'s whole loop vs a raw torch DDP loop (same GPT, batch, AdamW, clipping)",
     "overhead/overhead.json", "`python -m brigade.results.overhead`")
def _overhead(d: dict) -> str:
    # A file without "config" was written by the older bench, which timed Trainer.train_step only.
    what = "" if "config" in d else "; measured on Trainer.train_step alone, before the whole-loop bench"
    return (f"{100 * d['overhead']:+.1f} % ({d['brigade_median_s'] * 1e3:.1f} vs "
            f"{d['raw_median_s'] * 1e3:.1f} ms per step){what}")


@row("MLP 8 × Linear(1024), batch 256, 2 stages, m = 2, zero-bubble", "speed/speed.json",
     "`python -m brigade.results.speed --schedule zb --microbatches 2`")
def _speed_zb(d: dict) -> str:
    c, f = d["cases"][0], _speed_figures(d)
    peer = c.get("torch_class", c["torch_schedule"].upper())  # files before torch_class: the name
    return (f"{f['ours']} ms: ×{f['vs']} torch.distributed.pipelining's {peer} "
            f"({f['theirs']} ms), ×{c['speedup_vs_single']:.2f} a single device, efficiency {f['eff']}")


@row("same, 1F1B on both sides", "speed-1f1b/speed.json",
     "`python -m brigade.results.speed --schedule 1f1b --microbatches 2`")
def _speed_1f1b(d: dict) -> str:
    f = _speed_figures(d)
    return f"brigade {f['ours']} ms vs torch {f['theirs']} ms (×{f['vs']}), efficiency {f['eff']}"


def _speed_figures(d: dict) -> dict[str, str]:
    """The figures both speed rows print, rounded as the table has them."""
    c = d["cases"][0]
    ours = c.get("brigade_median_s", c["brigade_mean_s"])  # files before the rounds: means
    theirs = c.get("torch_pipelining_median_s", c["torch_pipelining_mean_s"])
    return {"ours": f"{ours * 1e3:.1f}", "theirs": f"{theirs * 1e3:.1f}",
            "vs": f"{c['vs_torch_pipelining']:.2f}", "eff": f"{c['efficiency']:.2f}"}


def _name(row: dict) -> str:
    if row.get("schedule") is None:  # the tuner's data-parallel candidate
        return f"DDP, dp = {row.get('dp', 2)}"
    v = f", V = {row['virtual']}" if row.get("virtual", 1) > 1 else ""
    return f"{row['schedule'].upper()}{v}, m = {row['microbatches']}"


def _versus(d: dict, ours: dict, theirs: dict) -> str:
    """torch's best ÷ brigade's best (> 1: brigade faster), first of the two medians the row shows,
    so that the figure follows from them; then the median of the per-round ratios with its CI,
    which is what can rank them (the two differ where the rounds vary: files before the rounds
    have only the first)."""
    of_medians = f"×{typical(theirs) / typical(ours):.2f}"
    if "best" not in d:
        return of_medians
    b = d["best"]
    lo, hi = b["vs_torch_ci"]
    rank = "" if b["vs_torch_ranked"] else ", cannot rank"
    bound = (f"; any plan: at most ×{b['bound_vs_torch']:.3f} on these cuts, "
             f"×{b['balanced_bound_vs_torch']:.3f} on any" if "bound_vs_torch" in b else "")
    return f"{of_medians} of the medians; per round ×{b['vs_torch']:.2f}, 95 % CI {lo:.2f}–{hi:.2f}{rank}{bound}"


_GPT = ("bench-gpt/bench.json", "`brigade bench --model gpt --quick`")
_MLP = ("bench-mlp/bench.json", "`brigade bench --model mlp --batch-size 256 --splits 128`")
_RESNET = ("bench/bench.json", "`brigade bench --splits 4,2`")
_GPT4 = ("bench-gpt-pp4/bench.json", "`brigade bench --model gpt --quick --ranks 4`")
_MLP4 = ("bench-mlp-pp4/bench.json", "`brigade bench --model mlp --batch-size 256 --splits 32 --ranks 4`")
_RESNET4 = ("bench-resnet-pp4/bench.json", "`brigade bench --splits 4,2 --ranks 4`")


def _best_vs_best(d: dict) -> str:
    p = dict(headline(d["configs"]))
    ours, theirs = p["brigade pipelined (best)"], p["torch pipelining (best)"]
    one, best = typical(p["Single device"]), typical(ours)
    single = f"×{one / best:.2f} one device ({one:.3f} s); the bench took {d['wall_s']:.0f} s"
    return (f"best brigade ({_name(ours)}) {best:.3f} s, torch's best ({_name(theirs)}) {typical(theirs):.3f} s: "
            f"torch ÷ brigade {_versus(d, ours, theirs)}; {single}")


row("GPT 8×256, context 128, batch 32", *_GPT)(_best_vs_best)
row("MLP 8 × Linear(1024), batch 256, m = 2, every schedule", *_MLP)(_best_vs_best)


@row("ResNet-50, 64 px, batch 32, split sizes 4 and 2 (m = 8, 16)", *_RESNET)
def _bench_resnet(d: dict) -> str:
    p = dict(headline(d["configs"]))
    one, mp = typical(p["Single device"]), typical(p["Model parallel"])
    ours, theirs = p["brigade pipelined (best)"], p["torch pipelining (best)"]
    return (f"single {one:.3f} s; model parallel {mp:.3f} s ({100 * (one / mp - 1):+.0f} %); best brigade "
            f"({_name(ours)}) {typical(ours):.3f} s; torch's best {typical(theirs):.3f} s (torch ÷ brigade "
            f"{_versus(d, ours, theirs)}); DDP {typical(p['DDP']):.3f} s; "
            f"the bench took {d['wall_s']:.0f} s")


@row("ResNet-50 as above, m = 8, with malloc's defaults (freed memory handed back to the OS)",
     "bench-malloc/bench.json", "`brigade bench --splits 4 --schedules 1f1b --malloc-defaults`")
def _malloc_defaults(d: dict) -> str:
    at = {(r["name"], r["schedule"], r["microbatches"]): r["median_s"] for r in d["configs"]}
    kept = "kept" if d.get("freed_memory_kept") else "handed back"
    return (f"single {at['single', None, 1]:.3f} s; 1F1B brigade {at['brigade', '1f1b', 8]:.3f} s, torch "
            f"{at['torch.distributed.pipelining', '1f1b', 8]:.3f} s; DDP {at['ddp', None, 1]:.3f} s (freed "
            f"memory {kept})")


def _per_schedule(d: dict) -> str:
    """brigade ÷ torch at each (schedule, V, m) both ran (× > 1: brigade faster; ? where the
    per-round CI holds 1), and brigade's efficiency range."""
    rows = [r for r in d["configs"] if r.get("name") == "brigade" and r.get("vs_torch") is not None]
    if not rows:
        return "no (schedule, m) that both ran"
    parts = [f"{_name(r)} ×{r['vs_torch']:.2f}{'' if r.get('vs_torch_ranked', True) else '?'}" for r in rows]
    effs = [r["efficiency"] for r in d["configs"] if r.get("name") == "brigade" and r.get("efficiency")]
    slower = sum(r["vs_torch"] < 1 and r.get("vs_torch_ranked", True) for r in rows)
    return (f"{'; '.join(parts)} — slower than torch at {slower} of {len(rows)}; brigade's efficiency "
            f"{min(effs):.2f}–{max(effs):.2f}")


for _model, _source in (("GPT", _GPT), ("ResNet-50", _RESNET), ("MLP", _MLP)):
    row(f"{_model}, schedule for schedule: brigade ÷ torch (per-round median)", *_source)(_per_schedule)


def _auto(d: dict) -> str:
    """At each m: auto's faster row (V 1 or 2) against the fastest hand-written row there
    (brigade's or torch's, by median), as the median per-round ratio with its CI (× > 1: auto
    faster), and auto's median step over its balanced bound (any cut, any schedule, transfers
    free: 1.000 would be at it)."""
    rows = [r for r in d["configs"] if r["name"] in ("brigade", "torch.distributed.pipelining")]
    parts = []
    for m in sorted({r["microbatches"] for r in rows}):
        here = [r for r in rows if r["microbatches"] == m]
        autos = [r for r in here if r["name"] == "brigade" and r["schedule"] == "auto"]
        hand = [r for r in here if r not in autos]
        if not autos or not hand:
            continue
        a, h = (min(side, key=lambda r: r["median_s"]) for side in (autos, hand))
        ratio, lo, hi = ratio_ci(h["rounds_s"], a["rounds_s"])
        who = "torch's " if h["name"] != "brigade" else ""
        bound = f", {a['median_s'] / a['balanced_bound_s']:.3f} × its balanced bound" \
            if a.get("balanced_bound_s") else ""
        parts.append(f"m = {m}: auto V = {a['virtual']} ×{ratio:.3f} ({lo:.2f}–{hi:.2f}) vs {who}"
                     f"{_name(h)}{bound}")
    return "; ".join(parts) or "no auto row"


_PP4 = " at pp 4 (4 processes on 2 cores)"
for _model, _source in (("GPT", _GPT), ("ResNet-50", _RESNET), ("MLP", _MLP), ("GPT" + _PP4, _GPT4),
                        ("ResNet-50" + _PP4, _RESNET4), ("MLP" + _PP4, _MLP4)):
    row(f"{_model}, --schedule auto against the fastest hand-written schedule at each m (brigade's or "
        "torch's; per-round median, 95 % CI; × > 1: auto faster)", *_source)(_auto)


@row("the shortest step any schedule of whole blocks can take (least lower bound over every cut, "
     "transfers free) against the balanced bound, for the bench rows above", "bound/bound.json",
     "`python -m brigade.results.cut_bound`")
def _cut_bound(d: dict) -> str:
    parts = []
    for r in d["rows"]:
        parts.append(f"{r['model']} pp {r['pp']} V {r['virtual']} {r['placement']} m {r['microbatches']} "
                     f"{r['ratio']:.3f}")
    out = sum(not r["within"] for r in d["rows"])
    return "; ".join(parts) + f" × balanced ({out} of {len(d['rows'])} above +{100 * d['within']:.0f} %)"


@row("snapshot at the default interval (every 100 steps, in the background), main job", "train/snapshot.json",
     "`brigade train --max-steps 300`")
def _snapshot(d: dict) -> str:
    s = d["snapshot_s"]
    share = sum(s) / len(s) / (d["snapshot_every"] * d["step_s"])
    return (f"{min(s):.3f}–{max(s):.3f} s stall per snapshot vs {d['step_s']:.3f} s per step: "
            f"≈ {100 * share:.2f} % of training time; the last, written at once, {d['final_s']:.2f} s")


@row("restart after `kill:rank=1:step=150`", "faults/restart.json",
     "`brigade train --max-steps 300 --inject-fault kill:rank=1:step=150 --max-restarts 1`")
def _restart(d: dict) -> str:
    return (f"the restarted worker (attempt {d['attempt']}, resumed from step {d['resumed_from']}) "
            f"completes its first step {d['first_step_s']:.2f} s after its process starts")


@row("two hosts (network namespaces, veth), dp 2 × pp 2 across them", "two-hosts/two_hosts.json",
     "`python -m pytest -m full tests/e2e/test_two_hosts.py` (as root)")
def _two_hosts(d: dict) -> str:
    same = "the one-host run's `params_sha256` and losses" if d["same_params_sha256"] and d["same_losses"] \
        else "DIFFERENT parameters or losses than one host"
    return (f"host 1 killed after step {d['killed_after_step']}: resumed from the step-"
            f"{d['resumed_from']} snapshot and finished {d['finished_s_after_kill']:.0f} s after the kill "
            f"with {same}")


@row("`brigade doctor` across those two hosts, 2 processes each", "two-hosts/doctor.json",
     "`brigade doctor --nnodes 2 --node-rank K --rdzv-endpoint 10.213.0.1:29631` in each namespace")
def _doctor(d: dict) -> str:
    speeds = (f"{d['allreduce_4mib_ms']:.0f} ms ({d['allreduce_gbps_per_link']:.2f} GB/s per link); "
              f"P2P 4 MiB at {d['p2p_gbps']:.1f} GB/s")
    skew = f"clock skew {d['clock_skew_ms']:.1f} ms"
    return f"all-reduce latency {d['allreduce_latency_ms']:.2f} ms, 4 MiB in {speeds}; {skew}"


@row("hang report for `stall:rank=1:step=5`, dp 2 × pp 2, `--hang-timeout 10`", "faults/hang.json",
     "`brigade train --nproc 4 --pp 2 --hang-timeout 10 --inject-fault stall:rank=1:step=5`")
def _hang(d: dict) -> str:
    return (f"table, stacks and verdict naming rank {d['stuck_rank']} printed {d['stuck_for_s']:.1f} s "
            f"after its last action; the command returned (exit {d['exit_code']}) {d['wall_s']:.0f} s "
            "after it started")


@row("tuner: layout, schedule, stages per rank, split size and cut points for the GPT 8×256",
     "tune-gpt/tune.json",
     "`brigade tune --model gpt --quick --verify`")
def _tune(d: dict) -> str:
    c, b = d["chosen"], d["sweep_best"]
    if "chosen_sweep_mean_s" in d:
        timed = f"{d['chosen_sweep_mean_s']:.3f} s timed again in the sweep"
    else:  # written before --verify timed the choice again
        timed = f"{d['chosen_mean_s']:.3f} s as timed by the search (not again in the sweep)"
    balance = f", balance {c['balance']}" if c.get("balance") else ""
    return (f"{d['trials']} trials of the sweep's {d['sweep_trials']} (schedule × V × m, and DDP); chose "
            f"{_name(c)}{balance}: {timed}, {100 * d['within']:+.1f} % from the sweep's best ({_name(b)})")




ROWS: list[Row] = [*_OWN, *memory_rows.ROWS, *data_rows.ROWS, *fault_rows.ROWS]  # the table's order


def table(results: str | Path = "results") -> str:
    """The Markdown table, every figure read from its file under `results`.

    Raises:
        FileNotFoundError: a row's file is missing. KeyError: a file lacks a figure its row needs.
    """
    lines = ["| what | figure | reproduce | file | measured at |", "|---|---|---|---|---|"]
    for row in ROWS:
        data = json.loads((Path(results) / row.file).read_text(encoding="utf-8"))
        lines.append(f"| {row.what} | {row.figure(data)} | {row.reproduce} | `results/{row.file}` | "
                     f"{measured_at(data)} |")
    return "\n".join(lines)
