"""Predicted memory of each rank by kind, the kinds `train/memory.py` measures:

    params       its stages' parameter bytes (a tied weight once per rank), ÷ shard
    grads        the same
    optimizer    AdamW: two fp32 moments per parameter, 2 × params
    activations  Σ over its stages: held per sample × micro-batch size × the micro-batches the
                 plan holds at once (simulate's peak_held), plus the largest working set one
                 backward adds on top (a recompute's tensors)
    peak         params + optimizer + the whole unsharded gradient (made during the backward)
                 + activations + the largest transient of a block (temporaries) + the layout's
                 extras: under DDP the reducer's flat buckets (a copy of the gradients); sharded,
                 the gathered parameters of its stages (kept for the step) and their unsharded
                 gradients before the reduce-scatter

All figures are the planner's model of what `brigade train` measures at step 2; the accuracy
benchmark (`bench/plan_accuracy.py`) holds them against it.
"""

from __future__ import annotations

from brigade.pipeline.plans.schedule import stages_on
from brigade.plan.costs import ModelCosts
from brigade.plan.space import Layout


def rank_memory(
    costs: ModelCosts, layout: Layout, balance: list[int], peak_held: dict[int, int], mb: int, pp_rank: int
) -> dict[str, float]:
    """Bytes of each kind (and `peak`) on the ranks at pipeline position `pp_rank`."""
    bounds = [0, *[sum(balance[: k + 1]) for k in range(len(balance))]]
    stages = stages_on(layout.schedule, layout.pp, pp_rank, layout.virtual) if layout.pp > 1 else [0]
    blocks = [b for s in stages for b in range(bounds[s], bounds[s + 1])]
    whole = costs.param_bytes(blocks)
    mine = whole / layout.shard
    mode = costs.modes[layout.recompute]
    held = sum(sum(mode.held[bounds[s] : bounds[s + 1]]) * mb * peak_held.get(s, 1) for s in stages)
    working = max(mode.working[b] for b in blocks) * mb
    transient = max(mode.transient[b] for b in blocks) * mb
    activations = held + working
    if layout.shard > 1:
        extra = whole - mine  # the gathered parameters beyond its shard
    elif layout.dp > 1:
        extra = whole  # the reducer's buckets
    else:
        extra = 0.0
    peak = mine + 2 * mine + whole + activations + transient + extra
    return {"params": mine, "grads": mine, "optimizer": 2 * mine, "activations": activations, "peak": peak}


def worst(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The rank with the highest peak."""
    return max(per_rank, key=lambda r: r["peak"])
