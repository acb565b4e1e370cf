"""How close `brigade plan` comes: predicted against measured step time and per-rank peak memory
for layouts this machine runs, each a real `brigade train` of a few steps.

    python -m brigade.results.plan_accuracy --out results/plan          (about 20 minutes a round on 2 cores)
    python -m brigade.results.plan_accuracy --tiny --rounds 1 --out /tmp/p   (tests this script)

The cluster is this machine (the "cpu" device, one node; 4 processes share its cores, which the
planner models). The layouts: the GPT, the MLP and examples/llama.py (a structured input) under
data parallel (DDP, FSDP2, HSDP), pipelines of every kind of schedule, recompute, tensor parallel
with sequence parallel (tp 2 × pp 2, tp 2 × shard 2) and FSDP2's bf16 (its costs timed in bf16,
`planner.costs.measure`). Each layout is predicted (`planner.predict`) on costs the planner itself measures
and trained with the predicted cut (`--balance`). Measured: the median `step_time_s` of the steps
after the second, and each rank's `peak` from the `memory` event (step 2). Errors are
(predicted − measured) ÷ measured; memory's is the worst rank's.

In rounds: each round probes this machine again and trains every layout, in an order turned by
one each round, and a layout's figures are the medians of its rounds'. Each layout's costs are
measured just before it trains, in a process of its own (its micro-batch size and recompute mode
only, about 10 s). On this machine both sides drift with what else its host runs: the same
layout's step moved by 13-29 % between runs minutes apart, AdamW's step on the MLP's parameters
took 3 ms a MiB at one moment and 1.5 ms five minutes later, and costs measured once for a whole
round predicted the pipelines 40 % slower in one round than in the next. Measured together,
costs and step see the machine in much the same state; what drift is left, the medians absorb.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from brigade.errors import BrigadeError, RunError
from brigade.planner.devices import cpu
from brigade.results import script
from brigade.results.footprint import QUIET
from brigade.train.metrics import events, read_records, training
from brigade.world.degrees import Degrees

GPT = {"n_layer": 4, "n_embd": 256, "n_head": 4, "seq_len": 64, "batch_size": 16}
GPT_TINY = {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 32, "batch_size": 8}
LLAMA = "examples/llama.py:model"  # a structured input (tokens and a padding mask), a tied head
SIZES = {"mlp": {"batch_size": 32}, LLAMA: {"batch_size": 16}}  # the GPT's: GPT or GPT_TINY
# (model, replicate, shard, pp, schedule, V, m, recompute[, tp, precision]): tp 1 and fp32 unless given
CASES = [
    ("gpt", 1, 1, 1, "1f1b", 1, 1, "none"),
    ("gpt", 2, 1, 1, "1f1b", 1, 1, "none"),
    ("gpt", 2, 1, 1, "1f1b", 1, 1, "full"),
    ("gpt", 1, 2, 1, "1f1b", 1, 1, "none"),
    ("gpt", 1, 1, 2, "1f1b", 1, 4, "none"),
    ("gpt", 1, 1, 2, "1f1b", 1, 4, "full"),
    ("gpt", 1, 1, 2, "interleaved", 2, 4, "none"),
    ("gpt", 1, 1, 2, "zb", 1, 4, "none"),
    ("gpt", 1, 1, 2, "zbv", 2, 4, "none"),
    ("gpt", 2, 1, 2, "1f1b", 1, 4, "none"),
    ("gpt", 2, 2, 1, "1f1b", 1, 1, "none"),
    ("gpt", 1, 2, 2, "zb", 1, 2, "none"),
    ("gpt", 1, 1, 2, "auto", 2, 4, "none"),
    ("mlp", 2, 1, 1, "1f1b", 1, 1, "none"),
    ("mlp", 1, 1, 2, "1f1b", 1, 4, "none"),
    ("mlp", 1, 1, 2, "zb", 1, 4, "full"),
    ("gpt", 1, 2, 1, "1f1b", 1, 1, "none", 1, "bf16"),  # FSDP2's mixed precision
    ("gpt", 1, 1, 2, "1f1b", 1, 4, "none", 2, ""),  # tp 2 × pp 2, sequence parallel
    ("gpt", 1, 2, 1, "1f1b", 1, 1, "none", 2, ""),  # tp 2 × shard 2
    (LLAMA, 2, 1, 1, "1f1b", 1, 1, "none"),
    (LLAMA, 1, 1, 2, "1f1b", 1, 4, "none"),
]
# dp 2; pp 2 1f1b; the MLP under dp 2; tp 2 × pp 2
TINY_CASES = [CASES[1], CASES[4], CASES[13], CASES[17]]


def _case(case: tuple) -> tuple:
    """A case with its tp and precision: (model, replicate, shard, pp, schedule, V, m, recompute,
    tp, precision)."""
    return (*case, 1, "")[:10] if len(case) == 8 else case
ROUNDS = 3  # rounds of costs and training whose medians a row holds (module docstring)


def train(args: list[str], steps: int) -> dict:
    """`brigade train` with `args`: the median step time after step 2, every rank's peak and
    every rank's activations (the `memory` event's, step 2)."""
    with tempfile.TemporaryDirectory(prefix="brigade-plan-") as tmp:
        argv = [
            sys.executable,
            "-m",
            "brigade",
            "train",
            "--out",
            tmp,
            *QUIET,
            *args,
            "--max-steps",
            str(steps),
        ]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
            raise RunError(f"brigade train {' '.join(args)}: exit {done.returncode}: {tail}")
        recs = read_records(Path(tmp))
    (mem,) = events(recs, "memory")
    ranks = sorted({int(k.split("/")[0][4:]) for k in mem if k.startswith("rank")})
    return {
        "step_s": statistics.median(r["step_time_s"] for r in training(recs) if r["step"] > 2),
        "peak": [mem[f"rank{r}/peak"] for r in ranks],
        "activations": [mem[f"rank{r}/activations"] for r in ranks],
    }


def _flags(pairs: dict) -> list[str]:
    """``{"n_layer": 2}`` → ``["--n-layer", "2"]``."""
    return [x for k, v in pairs.items() for x in ("--" + k.replace("_", "-"), str(v))]


def _model_args(model: str, sizes: dict) -> list[str]:
    if model != "gpt":
        return _flags({"model": model, "batch_size": sizes["batch_size"]})
    return _flags({"model": "gpt", "n_layer": sizes["n_layer"], "n_embd": sizes["n_embd"],
                   "n_head": sizes["n_head"], "context": sizes["seq_len"], "block_size": sizes["seq_len"],
                   "batch_size": sizes["batch_size"]})


def _costs(model: str, sizes: dict, cases: list[tuple], here):
    """The planner's costs of `model` (every micro-batch size and mode the cases need, timed in
    their precision), measured on `here` (this machine's probed `DeviceSpec`), with what tensor
    parallel does to its blocks and what FSDP2's own work adds to them."""
    from brigade.config import ModelConfig
    from brigade.planner.config import PlanConfig
    from brigade.planner.costs import measure
    from brigade.planner.run import load_spec, model_config
    from brigade.planner.split_costs import TP
    from brigade.planner.tensor import facts
    from brigade.train.memory import quiet_stderr

    cfg = PlanConfig(model=model, batch_size=sizes["batch_size"], seq_len=sizes.get("seq_len", 0))
    base = ModelConfig(
        n_layer=sizes.get("n_layer", 4), n_head=sizes.get("n_head", 4), n_embd=sizes.get("n_embd", 128)
    )
    spec = load_spec(cfg, model_config(cfg, base))
    mbs = sorted({sizes["batch_size"] // (c[1] * c[2] * c[6]) for c in cases})
    (precision,) = {_case(c)[9] for c in cases}
    with quiet_stderr():
        costs = measure(spec, mbs, sorted({c[7] for c in cases}), here, precision,
                        tp=any(_case(c)[8] == TP for c in cases), shard=any(c[2] > 1 for c in cases))
    costs.tensor = facts(spec.blocks)
    return costs


def fresh_costs(model: str, sizes: dict, cases: list[tuple], here):
    """`_costs` in a process of its own, each measurement starting as `brigade plan`'s does. In a
    run that measured them again and again in this one long-lived process, the MLP's dp 2 row
    went from +2 % in the first rounds to +48 % in the later ones while its training steps did
    not move."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_costs, model, sizes, cases, here).result()


def run_case(case: tuple, costs, where, sizes: dict, steps: int) -> dict:
    """One round of one layout: its prediction on `costs` and one `brigade train` of it."""
    from dataclasses import replace

    from brigade.pipeline.plans.costs import Costs
    from brigade.pipeline.plans.schedule import SCHEDULES, build
    from brigade.planner.predict import predict
    from brigade.planner.space import Layout

    model, rep, shard, pp, schedule, v, m, mode, tp, precision = _case(case)
    layout = Layout(rep, shard, pp, schedule, v, m, mode, tp=tp)
    here = replace(where, per_node=layout.world)
    # train measures memory on step 2, before a costed schedule (auto) plans again on its times:
    # on the plan of unit costs it starts with, which is the one to predict the memory of.
    unit = (build(schedule, pp, m, v, Costs.unit(pp * v)) if SCHEDULES[schedule].costed and pp > 1
            else None)
    row = predict(costs, layout, here, sizes["batch_size"], sizes.get("seq_len", 0), precision,
                  memory_plan=unit)
    args = [*_model_args(model, sizes), *_flags({"nproc": layout.world, "pp": pp, "shard": shard,
                                                  "schedule": schedule, "virtual": v, "microbatches": m,
                                                  "recompute": mode, "tp": tp})]
    args += ["--precision", precision] if precision else []
    if pp > 1:
        args += ["--balance", ",".join(map(str, row["balance"]))]
    got = train(args, steps)
    degrees = Degrees(dp=rep * shard, shard=shard, pp=pp, tp=tp)  # each rank's pipeline position
    predicted = [row["memory_per_stage_rank"][degrees.coords(r).pp]["peak"] for r in range(layout.world)]
    mem_err = max((p - g) / g for p, g in zip(predicted, got["peak"]))
    mem_err = max(mem_err, min((p - g) / g for p, g in zip(predicted, got["peak"])), key=abs)
    return {
        "model": model,
        "layout": layout.to_json(),
        "label": layout.label() + (f", {precision}" if precision else ""),
        "balance": row["balance"],
        "predicted_step_s": row["step_s"],
        "measured_step_s": got["step_s"],
        "step_error": (row["step_s"] - got["step_s"]) / got["step_s"],
        "predicted_peak": predicted,
        "measured_peak": got["peak"],
        "memory_error": mem_err,
        "source": row["source"],
    }


def one_round(k: int, cases: list[tuple], gpt: dict, steps: int, runs: dict[tuple, list[dict]],
              reprobe: bool = True) -> dict:
    """Round `k`: this machine probed again, then each case's costs measured and the case trained
    at once (module docstring), in an order turned by `k`; each result appended to `runs[case]`.
    Returns the round's probe of this machine. `reprobe=False` (--tiny, which tests the script):
    the probe of the last day where one is kept, as `brigade plan` takes it (20 s saved)."""
    from brigade.planner.cluster import Cluster

    where = Cluster(1, 4, cpu(reprobe=reprobe))  # this machine, with as many ranks as the largest case
    for model in dict.fromkeys(c[0] for c in cases):
        sizes = gpt if model == "gpt" else SIZES[model]
        mine = [c for c in cases if c[0] == model]
        for case in mine[k % len(mine):] + mine[: k % len(mine)]:
            costs = fresh_costs(model, sizes, [case], where.device)
            runs[case].append(run_case(case, costs, where, sizes, steps))
            r = runs[case][-1]
            print(
                f"round {k + 1}: {model:>4} {r['label']:<34} step {r['measured_step_s'] * 1e3:7.1f} ms, "
                f"predicted {r['predicted_step_s'] * 1e3:7.1f} ({100 * r['step_error']:+.1f} %); peak "
                f"{max(r['measured_peak']) / 2**20:6.1f} MiB ({100 * r['memory_error']:+.1f} %)",
                flush=True,
            )
    return asdict(where.device)


def medians(runs: list[dict]) -> dict:
    """One layout's row from its rounds: the median predicted and measured step (and the error
    between them), each round's figures kept; memory, which does not drift, from the first."""
    row = dict(runs[0])
    row["predicted_step_s"] = statistics.median(r["predicted_step_s"] for r in runs)
    row["measured_step_s"] = statistics.median(r["measured_step_s"] for r in runs)
    row["step_error"] = (row["predicted_step_s"] - row["measured_step_s"]) / row["measured_step_s"]
    row["rounds"] = [{k: r[k] for k in ("predicted_step_s", "measured_step_s", "memory_error")} for r in runs]
    return row


def summary(rows: list[dict]) -> dict:
    steps = [abs(r["step_error"]) for r in rows]
    mems = [abs(r["memory_error"]) for r in rows]
    return {
        "layouts": len(rows),
        "median_step_error": statistics.median(steps),
        "worst_step_error": max(steps),
        "median_memory_error": statistics.median(mems),
        "worst_memory_error": max(mems),
    }


def plot(result: dict, path: Path) -> None:
    """Predicted against measured, step time and peak memory, from the JSON's figures only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    pairs = [
        (
            [r["measured_step_s"] * 1e3 for r in result["rows"]],
            [r["predicted_step_s"] * 1e3 for r in result["rows"]],
            "step time (ms)",
        ),
        (
            [max(r["measured_peak"]) / 2**20 for r in result["rows"]],
            [max(r["predicted_peak"]) / 2**20 for r in result["rows"]],
            "peak memory of the busiest rank (MiB)",
        ),
    ]
    for ax, (x, y, what) in zip(axes, pairs):
        ax.scatter(x, y, color="#4c72b0")
        hi = max(x + y) * 1.1
        ax.plot([0, hi], [0, hi], color="gray", lw=1)
        ax.fill_between([0, hi], [0, 0.9 * hi], [0, 1.1 * hi], color="gray", alpha=0.15, label="±10 %")
        ax.set_xlabel(f"measured {what}")
        ax.set_ylabel(f"predicted {what}")
        ax.legend(fontsize=8)
    s = result["summary"]
    fig.suptitle(
        f"brigade plan on this machine, {s['layouts']} layouts: step time median "
        f"{100 * s['median_step_error']:.1f} %, worst {100 * s['worst_step_error']:.1f} %; memory worst "
        f"{100 * s['worst_memory_error']:.1f} %",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m brigade.results.plan_accuracy", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", default="results/plan", help="folder for accuracy.json and accuracy.png")
    p.add_argument("--steps", type=int, default=16, help="training steps per layout (≥ 4)")
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help="rounds: costs measured again and every layout trained once in each (≥ 1)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny sizes, 4 layouts, this machine's kept probe: tests the script, not the planner")
    args = p.parse_args(argv)
    if args.rounds < 1:
        raise BrigadeError(f"--rounds {args.rounds}: need at least 1")
    if args.steps < 4:
        raise BrigadeError(
            f"--steps {args.steps}: need at least 4 (memory is measured on step 2, times after it)"
        )
    cases = TINY_CASES if args.tiny else CASES
    gpt = GPT_TINY if args.tiny else GPT
    runs: dict[tuple, list[dict]] = {c: [] for c in cases}
    probed = [one_round(k, cases, gpt, args.steps, runs, reprobe=not args.tiny) for k in range(args.rounds)]
    rows = [medians(runs[c]) for c in cases]
    result = {
        "gpt": gpt,
        **SIZES,
        "steps": args.steps,
        "rounds": args.rounds,
        "devices": probed,  # each round's probe of this machine (`planner.devices.cpu`)
        "rows": rows,
        "summary": summary(rows),
        "command": "python -m brigade.results.plan_accuracy" + (" --tiny" if args.tiny else "")
        + (f" --rounds {args.rounds}" if args.rounds != ROUNDS else ""),
    }
    script.save(result, args.out, "accuracy", plot)
    return 0


if __name__ == "__main__":
    script.run(main, "brigade.results.plan_accuracy")
