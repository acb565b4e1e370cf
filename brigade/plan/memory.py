"""Predicted memory of each rank by kind, the kinds `train/memory.py` measures:

    params       its stages' parameter bytes (a tied weight once per rank), ÷ shard; under tp each
                 block's split share ÷ tp (activations are counted whole: an upper bound there)
    grads        the same
    optimizer    AdamW: two fp32 moments per parameter, 2 × params
    activations  Σ over its stages: held per sample × micro-batch size × the micro-batches the
                 plan holds at once (simulate's peak_held), plus the largest working set one
                 backward adds on top (a recompute's tensors)
    split        under a split backward (a plan with I and W instead of B), Σ over its stages of
                 what a micro-batch keeps from its I to its W beyond its activations (`kept`:
                 the gradient at each weight's output, and under recompute what I made again)
                 × micro-batch size × the micro-batches past their I but not their W at the
                 stage's busiest moment (below); 0 when every backward is whole
    peak         params + optimizer + the whole unsharded gradient (made during the backward)
                 + activations + split + the largest transient of a block (temporaries) + the
                 layout's extras: under DDP the reducer's flat buckets (a copy of the gradients);
                 sharded, the gathered parameters of its stages (kept for the step) and their
                 unsharded gradients before the reduce-scatter

A stage's busiest moment comes from walking its rank's actions in the plan's order (`moments`):
after each, n micro-batches are held (F done, B or W not) and j ≤ n of them are past their I;
the moment with the most n·held + j·kept is the busiest. It is where n peaks (peak_held) unless
one with fewer held has enough more past their I (zbv's stage 2 over 3 ranks and 8 micro-batches,
kept 0.7 × held as on the GPT, is busiest at 3,3 rather than 4,1). zb's last stage of two:

    F0   I0   F1   I1   W0   F2   I2   W1 ...      (n held, j past I) after each action
    1,0  1,1  2,1  2,2  1,1  2,1  2,2  1,1         busiest 2,2: split = 2 × kept × mb size

The first stage's input takes no gradient, so its I does nothing and its W the whole backward
(`pipeline.runtime.backward`): what it keeps from I to W is the gradient its output received.
Like activations, split is summed over a rank's stages at each one's busiest moment.

All figures are the planner's model of what `brigade train` measures at step 2; the accuracy
benchmark (`bench/plan_accuracy.py`) holds them against it.
"""

from __future__ import annotations

from brigade.pipeline.plans.action import B, F, I, Plan, W
from brigade.pipeline.plans.schedule import compute_only, stages_on
from brigade.plan.costs import ModeCosts, ModelCosts
from brigade.plan.space import Layout

Moments = dict[int, set[tuple[int, int]]]  # stage -> every (micro-batches held, of them past I)


def rank_memory(
    costs: ModelCosts, layout: Layout, balance: list[int], peak_held: dict[int, int], mb: int, pp_rank: int,
    moments: Moments | None = None,
) -> dict[str, float]:
    """Bytes of each kind (and `peak`) on the ranks at pipeline position `pp_rank`.

    Args:
        peak_held: per stage, the most micro-batches it holds at once (`simulate`'s).
        moments: per stage, what `moments(plan)` gives; None counts no split backward.
    """
    bounds = [0, *[sum(balance[: k + 1]) for k in range(len(balance))]]
    stages = stages_on(layout.schedule, layout.pp, pp_rank, layout.virtual) if layout.pp > 1 else [0]
    blocks = [b for s in stages for b in range(bounds[s], bounds[s + 1])]
    whole = costs.param_bytes(blocks, layout.tp)
    mine = whole / layout.shard
    mode = costs.modes[layout.recompute]
    held = sum(sum(mode.held[bounds[s] : bounds[s + 1]]) * mb * peak_held.get(s, 1) for s in stages)
    split = sum(_split(costs, mode, bounds, s, peak_held.get(s, 1), (moments or {}).get(s)) * mb
                for s in stages)
    working = max(mode.working[b] for b in blocks) * mb
    transient = max(mode.transient[b] for b in blocks) * mb
    activations = held + working
    if layout.shard > 1:
        extra = whole - mine  # the gathered parameters beyond its shard
    elif layout.dp > 1:
        extra = whole  # the reducer's buckets
    else:
        extra = 0.0
    peak = mine + 2 * mine + whole + activations + split + transient + extra
    return {"params": mine, "grads": mine, "optimizer": 2 * mine, "activations": activations,
            "split": split, "peak": peak}


def moments(plan: Plan) -> Moments:
    """Per stage, every (held, past I) pair it passes through (module docstring): after each of
    its compute actions, the micro-batches whose F is done and whose B or W is not, and how many
    of those are past their I. A plan without I and W gives only pairs (n, 0)."""
    seen: Moments = {}
    for acts in compute_only(plan).values():
        held: dict[int, int] = {}
        between: dict[int, int] = {}
        for a in acts:
            s = a.stage
            step = {F: (1, 0), I: (0, 1), B: (-1, 0), W: (-1, -1)}[a.op]
            held[s], between[s] = held.get(s, 0) + step[0], between.get(s, 0) + step[1]
            seen.setdefault(s, set()).add((held[s], between[s]))
    return seen


def _split(costs: ModelCosts, mode: ModeCosts, bounds: list[int], s: int, most: int,
           pairs: set[tuple[int, int]] | None) -> float:
    """Bytes per sample stage s's busiest moment adds for its split backward beyond its `most`
    held micro-batches' activations (module docstring); 0 without pairs or a micro-batch past I."""
    if not pairs or not any(j for _, j in pairs):
        return 0.0
    held = sum(mode.held[bounds[s] : bounds[s + 1]])
    if s == 0:  # I does nothing, W all: it keeps the gradient its output received (none if also last)
        kept = costs.out_bytes[bounds[1] - 1] if len(bounds) > 2 else 0.0
    else:
        kept = sum(mode.kept[bounds[s] : bounds[s + 1]])
    return max(0.0, max(n * held + j * kept for n, j in pairs) - most * held)


def worst(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The rank with the highest peak."""
    return max(per_rank, key=lambda r: r["peak"])
