"""How close any pipeline of a model's blocks can come to `balanced_bound`: the least
`lower_bound` over every cut of the blocks into p·V stages, on per-block costs measured here.

    python -m brigade.results.cut_bound --out results/bound        (about 3 minutes on 2 cores)
    python -m brigade.results.cut_bound --tiny --out /tmp/b         (tests this script)

`balanced_bound` spreads the model's compute evenly over the ranks, as if the blocks could be cut
anywhere; `lower_bound` holds for one cut and placement, whatever the schedule (every rank runs
its stages' m forwards and backwards, and the first micro-batch reaches each rank's first stage
before it starts). A real cut is made of whole blocks, so the least `lower_bound` over every
contiguous cut is the shortest step any schedule at that placement and m can take on these
costs, transfers and the runtime free. Where it is more than 2 % above `balanced_bound`, no
schedule — hand-written or generated — comes within 2 % of it; the `brigade bench` rows the
cases mirror (their models, batch and micro-batch sizes, p, V) are the `command` of each case.

Costs: each block's forward, whole backward, W and I (`measure.stages.block_costs`, median of 9,
one thread), at the micro-batch size of the case. Placements: one stage per rank (V 1), and at
V 2 the loop (interleaved, looped-BFS) and the V (ZB-V, DualPipeV, auto).
"""

from __future__ import annotations

import itertools
from functools import cache

from brigade.results import script

# (name, bench command the case mirrors, load_model options, batch, p, V, m)
GPT = {"gpt_cfg": {"vocab_size": 96, "block_size": 128, "n_layer": 8, "n_head": 4, "n_embd": 256,
                   "dropout": 0.0, "tie_embeddings": True}}
CASES = [
    ("gpt", "brigade bench --model gpt --quick", GPT, 32, 2, (1, 2), 8),
    ("gpt", "brigade bench --model gpt --quick --ranks 4", GPT, 32, 4, (1, 2), 8),
    ("mlp", "brigade bench --model mlp --batch-size 256 --splits 128", {}, 256, 2, (1, 2), 2),
    ("mlp", "brigade bench --model mlp --batch-size 256 --splits 32 --ranks 4", {}, 256, 4, (1, 2), 8),
    ("resnet50", "brigade bench --splits 4,2", {"image_size": 64}, 32, 2, (1, 2), 8),
    ("resnet50", "brigade bench --splits 4,2", {"image_size": 64}, 32, 2, (1, 2), 16),
    ("resnet50", "brigade bench --splits 4,2 --ranks 4", {"image_size": 64}, 32, 4, (1, 2), 8),
    ("resnet50", "brigade bench --splits 4,2 --ranks 4", {"image_size": 64}, 32, 4, (1, 2), 16),
]
TINY_GPT = {"gpt_cfg": {"vocab_size": 32, "block_size": 16, "n_layer": 3, "n_head": 2, "n_embd": 32,
                        "dropout": 0.0, "tie_embeddings": True}}
TINY_CASES = [("gpt", "brigade bench --model gpt --quick", TINY_GPT, 8, 2, (1, 2), 4)]
REPEATS = 9
WITHIN = 0.02  # the target: a step within 2 % of balanced_bound
PLACEMENTS = {(1, "single"): "1f1b", (2, "loop"): "interleaved", (2, "v"): "zbv"}  # one plan of each


def cuts(n_blocks: int, n_stages: int):
    """Every contiguous cut of `n_blocks` blocks into `n_stages` non-empty stages, as block counts."""
    for ends in itertools.combinations(range(1, n_blocks), n_stages - 1):
        bounds = (0, *ends, n_blocks)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def best_cut(costs: list[tuple[float, ...]], plan) -> tuple[float, list[int], int]:
    """(least lower_bound, its cut, cuts tried) over every cut of these per-block (forward,
    backward, weight, input) costs into the plan's stages."""
    from brigade.pipeline.plans.bounds import lower_bound

    n_stages = len({a.stage for acts in plan.values() for a in acts})
    best, where, tried = float("inf"), [], 0
    for cut in cuts(len(costs), n_stages):
        ends = list(itertools.accumulate(cut, initial=0))
        per = [[sum(c[j] for c in costs[a:b]) for a, b in zip(ends, ends[1:])] for j in range(4)]
        bound = lower_bound(plan, per[0], per[1], weight=per[2], input_grad=per[3])
        tried += 1
        if bound < best:
            best, where = bound, cut
    return best, where, tried


@cache
def _block_costs(model: str, options: str, size: int) -> tuple:
    """Per-block (forward, backward, weight, input) seconds of `model` at micro-batch `size` (the
    options as JSON, so that the cases of one model and size share one measurement)."""
    import json

    import torch

    from brigade.measure.stages import block_costs
    from brigade.models import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        spec = load_model(model, **_options(model, json.loads(options)))
        x, y = spec.make_batch(size, torch.Generator().manual_seed(0))
        return tuple(block_costs(spec.blocks, x, spec.loss_fn, y, repeats=REPEATS))
    finally:
        torch.set_num_threads(threads)


def _options(model: str, options: dict) -> dict:
    if model != "gpt":
        return options
    from brigade.models.gpt import GPTConfig

    return {"gpt_cfg": GPTConfig(**options["gpt_cfg"])}


def run_case(case: tuple) -> list[dict]:
    """One case's rows: per placement, the balanced bound, the least lower bound over every cut
    and their ratio (module docstring)."""
    import json

    from brigade.pipeline.plans.bounds import balanced_bound
    from brigade.pipeline.plans.schedule import build

    model, command, options, batch, p, virtuals, m = case
    costs = _block_costs(model, json.dumps(options, sort_keys=True), batch // m)
    rows = []
    for (v, placement), schedule in PLACEMENTS.items():
        if v not in virtuals or len(costs) < p * v:
            continue
        plan = build(schedule, p, m, v)
        # `balanced_bound` with every block a stage of its own: each block's cheaper backward
        # (whole, or I + W) counted, which no cut's stages can undercut
        whole = balanced_bound(build("1f1b", len(costs), m), *[[c[j] for c in costs] for j in range(2)],
                               weight=[c[2] for c in costs], input_grad=[c[3] for c in costs])
        whole *= len(costs) / p
        least, cut, tried = best_cut(list(costs), plan)
        rows.append({"model": model, "command": command, "pp": p, "virtual": v, "placement": placement,
                     "microbatches": m, "microbatch_size": batch // m, "blocks": len(costs),
                     "balanced_bound_s": whole, "least_lower_bound_s": least, "best_cut": cut,
                     "cuts": tried, "ratio": least / whole, "within": least / whole <= 1 + WITHIN})
    return rows


def plot(result: dict, path) -> None:
    """Each case's least lower bound over balanced_bound, against the 2 % line, from the JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['model']} pp {r['pp']} V {r['virtual']} {r['placement']}, m {r['microbatches']}"
              for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.5))
    ax.barh(range(len(rows)), [r["ratio"] for r in rows],
            color=["#55a868" if r["within"] else "#c44e52" for r in rows])
    ax.axvline(1 + WITHIN, color="gray", lw=1, ls="--", label="balanced_bound + 2 %")
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(left=1.0)
    ax.set_xlabel("least lower_bound over every cut ÷ balanced_bound")
    ax.legend(fontsize=8)
    ax.set_title("How close any schedule of whole blocks can come to the balanced bound", fontsize=9)
    script.close(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = script.parser("python -m brigade.results.cut_bound", __doc__, "results/bound",
                      "bound.json and bound.png", "a tiny GPT, tests the script, not the models")
    args = p.parse_args(argv)
    rows = [row for case in (TINY_CASES if args.tiny else CASES) for row in run_case(case)]
    for r in rows:
        print(f"{r['model']:>8} pp {r['pp']} V {r['virtual']} {r['placement']:<6} m {r['microbatches']:>2}: "
              f"least lower bound {r['least_lower_bound_s'] * 1e3:8.1f} ms at cut {r['best_cut']}, "
              f"{r['ratio']:.3f} × balanced_bound ({r['cuts']} cuts)", flush=True)
    result = {"within": WITHIN, "repeats": REPEATS, "rows": rows,
              "command": "python -m brigade.results.cut_bound" + (" --tiny" if args.tiny else "")}
    script.save(result, args.out, "bound", plot)
    return 0


if __name__ == "__main__":
    script.run(main, "brigade.results.cut_bound")
