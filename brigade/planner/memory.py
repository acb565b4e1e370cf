"""Predicted memory of each rank by kind, the kinds `train/memory.py` measures:

    params       its stages' parameter bytes (a tied weight once per rank), ÷ shard (÷ shard × cp
                 under cp where the stages are sharded, `shards`; whole under DDP); under tp each
                 block's split share ÷ tp; under ep a mixture's experts 1/ep of them, and where
                 the stages are sharded 1/dp (the group's share sharded over edp: `own_params`)
                 fp32 whatever the precision: every layout keeps fp32 master weights
    grads        the same (fp32: the reduced gradients the optimizer reads)
    optimizer    AdamW: two fp32 moments per parameter, 2 × params: 16 bytes a parameter in all
    activations  Σ over its stages: held per sample × micro-batch size × the micro-batches the
                 plan holds at once (simulate's peak_held), plus the largest working set one
                 backward adds on top (a recompute's tensors). Under tp, a block under sequence
                 parallel holds 1/tp of it but for the whole copies of the sequence its matmuls
                 gather (`ModelCosts.held`), and a head that splits its vocabulary holds 1/tp of
                 its logits; a block under plain tp is counted whole (an upper bound). A working
                 set is the one measured on a tp process where there is one, else tp 1's scaled
                 as the block's activations scale (`ModelCosts.working`)
    split        under a split backward (a plan with I and W instead of B), Σ over its stages of
                 what a micro-batch keeps from its I to its W beyond its activations (`kept`:
                 the gradient at each weight's output, and under recompute what I made again)
                 × micro-batch size × the micro-batches past their I but not their W at the
                 stage's busiest moment (below); 0 when every backward is whole
    peak         params + optimizer + the layout's extras (under DDP the reducer's flat buckets, a
                 copy of the gradients, of the dense weights only under --ep; sharded under a
                 pipeline, the gathered parameters of its stages, kept for the step: in fp32 the
                 whole beyond the rank's shard, in bf16 or fp16 a whole half-precision copy) + the
                 larger of two phases:
                 backward   Σ over its stages of the busiest moment's activations, split and
                            gradients (below) + the largest working set and transient of a block
                            (a recompute's tensors, temporaries; where a backward runs with the
                            stage's gradients made, as a pipeline's later micro-batches do, the
                            temporaries of one that adds into them and its largest new gradient,
                            `accumulating`; under tp those measured on one tp process, or
                            tp 1's ÷ tp for a block that splits its activations)
                 optimizer  the reduced gradients + what AdamW's step allocates on top of its
                            state (`opt_transient`, measured per block: on a CPU, where AdamW
                            updates one tensor at a time, about twice the largest parameter; with
                            its foreach update, as on a GPU, about a copy of the parameters)
                 Sharded without a pipeline (one stage, a whole backward) FSDP gathers, frees and
                 reduces block by block (`parallel.shard`): no whole copy for the step; the
                 backward phase holds the sharded gradients (not whole ones) as data parallel's
                 whole model holds its gradients (below: made as the activations are freed, so
                 beside them only from the second micro-batch on), and beside them what is
                 unsharded at once (`block_by_block`): the gathered weights of the root's
                 blocks and of two neighbouring blocks (half precision, or fp32 beyond the shard),
                 and the gradients being reduced (a half-precision gradient and its fp32 copy, or
                 fp32 and its flat copy)

Under context parallel (`--cp C`, `planner.context`) a process holds 1/C of each sequence: every
activation kind above (held, working, transient, kept, split, and the head's logits, each process
taking the loss on its part) is what mb/C whole sequences would hold, so `rank_memory` is called
with mb ÷ C; the all-to-alls' buffers are not counted apart, nor, under all-to-all, the key/value
heads repeated to the query heads where C does not divide them. Parameters, gradients and AdamW's
moments are ÷ shard × cp where the stages are sharded, whole under DDP, whose buckets stand
whenever dp × cp > 1.

Under expert parallel a process's activations are counted as one process's of the whole model:
with balanced routing its experts take on average as many rows (tokens × top_k) as its own tokens
send out, so what they hold for the backward is what it would hold alone (a router that sends more
to one group's experts makes that process hold more: not counted), and the all-to-alls' buffers
(the rows received, and regrouped by expert) are not counted apart. Under DDP the reducer's
buckets leave the experts out (`extra` counts the dense parameters only), and the experts'
gradients are all-reduced by hand through one flat copy after the backward, beside every
gradient (counted as the optimizer's step is, the larger of the two; measured on this machine
at ep 2 of dp 4, that moment is the step's peak: params + gradients + AdamW + the dense buckets
+ the flat copy, 141.1 MiB, to the 0.1).

Precision (`--precision`, as `parallel.assemble` applies it): where the stages are sharded
(`Degrees.sharded`), bf16 and fp16 are FSDP2's mixed precision, so every activation byte above
(held, working, transient, kept, split; measured in fp32) counts half; the gradients a stage holds
through its backward stay the fp32 ones (FSDP2 casts each unit's half-precision gradient into an
fp32 copy as the unit's backward ends, and frees it), and the gathered copy is a half-precision
one. The accuracy benchmark's GPT (4 × 256, shard 2, batch 16) peaks within 5.5 % of this in bf16
and 3.1 % in fp32 (`results/plan/accuracy.json`).
Elsewhere (DDP, no replicas) they are autocast over fp32 parameters, and activations count as
measured in fp32: an upper bound, as autocast keeps the outputs of norms and softmax, and the
residual stream after them, in fp32. Costs from shapes in bf16 or fp16 (`formula`) are counted as
the half-precision run holds them, what the model itself upcasts (its norms' fp32, the loss's fp32
logits, their log-softmax and gradients) at fp32's size (`ModelCosts.memory_dtype`): taken as they
are under FSDP2's mixed precision, twice them elsewhere (`activation_scale`).

A stage's busiest moment comes from walking its rank's actions in the plan's order (`moments`):
after each, n micro-batches are held (F done, B or W not), j ≤ n of them are past their I, and
g is 1 once the stage has made its gradients (its first B or W: they stay, accumulated, to the
optimizer step); the moment with the most n·held + j·kept + g·grads is the busiest. It is where
n peaks (peak_held) unless one with fewer held has enough more past their I (zbv's stage 2 over
3 ranks and 8 micro-batches, kept 0.7 × held as on the GPT, is busiest at 3,3 rather than 4,1),
or, where a stage holds one micro-batch at a time (data parallel's whole model), the gradients
outweigh its activations: a backward frees the activations as it makes the gradients, so one
micro-batch's step peaks at the larger of the two, not at their sum. Sharded under a pipeline
(FSDP2 holding the stage's whole gradients for the step), the gradients count at every moment:
measured, those peaks hold both (counted the other way, shard 2 × pp 2 came out 12-17 % under,
and so did shard 2 and HSDP when they too held the step's whole gradients). zb's last stage of two:

    F0     I0     F1     I1     W0     F2     I2     W1 ...   (n held, j past I, g) after each
    1,0,0  1,1,0  2,1,0  2,2,0  1,1,1  2,1,1  2,2,1  1,1,1    busiest 2,2,1: split = 2 × kept × mb

The first stage's input takes no gradient, so its I does nothing and its W the whole backward
(`pipeline.runtime.backward`): what it keeps from I to W is the gradient its output received.
Like activations, split is summed over a rank's stages at each one's busiest moment.

All figures are the planner's model of what `brigade train` measures at step 2; the accuracy
benchmark (`results/plan_accuracy.py`) holds them against it.
"""

from __future__ import annotations

from brigade.pipeline.plans.action import B, F, I, Plan, W
from brigade.pipeline.plans.schedule import compute_only, stages_on
from brigade.planner.costs import ModelCosts
from brigade.planner.space import Layout

Moments = dict[int, set[tuple[int, int, int]]]  # stage -> every (held, of them past I, grads made)


HALF = ("bf16", "fp16")  # the precisions that compute in half precision


def rank_memory(
    costs: ModelCosts, layout: Layout, balance: list[int], peak_held: dict[int, int], mb: int, pp_rank: int,
    moments: Moments | None = None, precision: str = "",
) -> dict[str, float]:
    """Bytes of each kind (and `peak`) on the ranks at pipeline position `pp_rank`.

    Args:
        peak_held: per stage, the most micro-batches it holds at once (`simulate`'s).
        mb: the samples of a micro-batch a process holds the activations of: under cp, its part
            of each sequence, as many sequences' worth as mb ÷ cp whole ones (a float then).
        moments: per stage, what `moments(plan)` gives; None: each stage at its peak held with
            its gradients made (an upper bound, and no split backward).
        precision: the run's ("" or "fp32", "bf16", "fp16"; the module docstring).
    """
    bounds = [0, *[sum(balance[: k + 1]) for k in range(len(balance))]]
    stages = _stages(layout, pp_rank)
    blocks = rank_blocks(layout, balance, pp_rank)
    whole, mine = own_params(costs, layout, blocks)
    mixed = precision in HALF and layout.degrees.sharded  # FSDP2's mixed precision
    amb = mb * activation_scale(costs, mixed)  # activation bytes per counted byte per sample, × mb
    at = {s: (moments or {}).get(s) or {(peak_held.get(s, 1), 0, 1)} for s in stages}
    blockwise = by_block(layout, at)  # FSDP its own way, block by block (below)
    if layout.degrees.sharded and not blockwise:  # the stage's whole gradient buffers stand
        at = {s: {(n, j, 1) for n, j, _ in pairs} for s, pairs in at.items()}  # from the start
    # each stage's share of the rank's whole (unsharded) gradient: a weight tied between two of
    # its stages counts once, as in `whole`; block by block, the sharded gradients alone
    own = [costs.param_bytes(range(bounds[s], bounds[s + 1]), layout.tp, layout.ep) for s in stages]
    grads = [mine] if blockwise else [whole * o / (sum(own) or 1.0) for o in own]
    busiest = [_busiest(costs, layout, bounds, s, amb, peak_held.get(s, 1), g, at[s])
               for s, g in zip(stages, grads)]
    held = sum(_held(costs, layout, bounds, s) * amb * peak_held.get(s, 1) for s in stages)
    split = sum(b["split"] for b in busiest)
    working = max(costs.working(layout.recompute, b, layout.tp) for b in blocks) * amb
    adding = not blockwise and any(n and g for pairs in at.values() for n, _, g in pairs)
    transient = block_transient(costs, layout, blocks, amb, adding)
    if mixed:
        extra = whole / 2  # a whole half-precision copy of its stages, gathered for the step
    elif layout.degrees.sharded:
        extra = whole - mine  # the gathered parameters beyond its shard (none at --shard 1)
    elif layout.dp * layout.cp > 1:  # the reducer's buckets (over dp × cp): all but --ep's experts
        extra = whole - (costs.expert_bytes(blocks, layout.ep) if layout.ep > 1 else 0.0)
    else:
        extra = 0.0
    backward = sum(b["bytes"] for b in busiest) + working + transient
    stepping = mine + costs.opt_transient_bytes(blocks) * (mine / (costs.param_bytes(blocks) or 1.0))
    if layout.ep > 1 and not layout.degrees.sharded:  # beside the gradients, the experts' one flat
        stepping = max(stepping, mine + costs.expert_bytes(blocks, layout.ep))  # copy, reduced by hand
    if blockwise:
        gathered, reducing = block_by_block(costs, blocks, layout.tp, layout.ep, expert_shard(layout) > 1)
        backward += gathered * (0.5 if mixed else 1 - 1 / shards(layout)) + reducing * (1.5 if mixed else 2.0)
        peak = 3 * mine + max(backward, stepping)
    else:
        peak = mine + 2 * mine + extra + max(backward, stepping)
    return {"params": mine, "grads": mine, "optimizer": 2 * mine, "activations": held + working,
            "split": split, "optimizer_step": stepping - mine, "peak": peak}


def activation_scale(costs: ModelCosts, mixed: bool) -> float:
    """A rank's activation bytes per byte of the costs' columns: counted in fp32 (measured), half
    of them under FSDP2's mixed precision (`mixed`); counted as a half-precision run holds them
    (`ModelCosts.memory_dtype`, from shapes), as they are under it, and elsewhere (autocast over
    fp32 parameters) twice them, the fp32 bound the module docstring counts."""
    if costs.memory_dtype in HALF:
        return 1.0 if mixed else 2.0
    return 0.5 if mixed else 1.0


def block_transient(costs: ModelCosts, layout: Layout, blocks: list[int], amb: float, adding: bool) -> float:
    """The largest temporaries one block's forward and backward allocate on this rank: measured
    on one tp process where the costs were (`split_costs`), else at tp 1. `adding`: some backward
    runs while the stage's gradients are made (a pipeline's later micro-batches, which add into
    them): then its own (`ModeCosts.accumulating`) and its largest new gradient beside them."""
    mode = costs.modes[layout.recompute]
    here = mode.split is not None and mode.split.tp == layout.tp > 1
    measured = mode.split if here else mode
    if not adding or not measured.accumulating:  # not measured at this tp: a split block's ÷ tp
        share = [1 / layout.tp if not here and costs.splits(b, layout.tp) else 1.0 for b in blocks]
        return max(measured.transient[b] * f for b, f in zip(blocks, share)) * amb
    largest = [costs.largest(b, layout.tp, layout.ep) for b in blocks]
    return max(g + measured.accumulating[b] * amb for g, b in zip(largest, blocks))


def by_block(layout: Layout, at: Moments) -> bool:
    """Whether FSDP gathers, frees and reduces block by block, every micro-batch: the layout is
    sharded without a pipeline and its backward is whole (no stage passes a moment with a
    micro-batch past its I), as `runtime.reduce.ShardedReducer` then leaves FSDP to do."""
    split = any(j for pairs in at.values() for _, j, _ in pairs)
    return layout.degrees.sharded and layout.pp == 1 and not split


def own_params(costs: ModelCosts, layout: Layout, blocks: list[int]) -> tuple[float, float]:
    """(whole, mine): the fp32 bytes of these blocks' parameters one process holds unsharded (its
    tp share; of a mixture's experts its expert group's 1/ep), and of those its own. Dense weights
    ÷ shard; experts, where the stages are sharded, ÷ the edp = dp/ep processes holding the same
    experts (`parallel.experts.shard_experts`: 1/dp of them in all), else whole (DDP leaves them
    out; they are all-reduced over edp by hand)."""
    whole = costs.param_bytes(blocks, layout.tp, layout.ep)
    experts = costs.expert_bytes(blocks, layout.ep)
    return whole, (whole - experts) / shards(layout) + experts / expert_shard(layout)


def expert_shard(layout: Layout) -> int:
    """The processes one process's experts are sharded over: at ep 1 the dense weights' (they are
    in the stage's own units), else edp = dp/ep where the stages are sharded (FSDP2), or 1."""
    if layout.ep == 1:
        return shards(layout)
    return layout.dp // layout.ep if layout.degrees.sharded else 1


def shards(layout: Layout) -> int:
    """The processes a stage's dense weights are sharded over: where the stages are sharded, FSDP2's
    shard × cp (`Degrees.fsdp`: the cp processes share the shards), else 1 (DDP keeps them whole).
    At cp 1 that is --shard."""
    return layout.degrees.fsdp if layout.degrees.sharded else 1


def block_by_block(costs: ModelCosts, blocks: list[int], tp: int, ep: int = 1,
                   experts: bool = True) -> tuple[float, float]:
    """Without a pipeline, what FSDP holds unsharded at once on one of `tp` processes, in fp32
    bytes: (gathered, reducing). Gathered: the root's blocks (those sharing a weight with another
    block: `parallel.shard` leaves them to the stage, gathered from its first forward to its last
    backward) and the two largest neighbouring blocks of the rest (one computing while the next
    is gathered). Reducing: the root's and the largest other block's gradients, unsharded, as a
    backward makes them and its reduce-scatter copies them into one flat fp32 input. `experts`
    False: a mixture's experts left out (under --ep with one process holding each group's share,
    edp 1, their FSDP unit neither gathers nor reduce-scatters anything)."""
    owners: dict[int, int] = {}
    for b in blocks:
        for pid in costs.params[b]:
            owners[pid] = owners.get(pid, 0) + 1
    root = [b for b in blocks if any(owners[pid] > 1 for pid in costs.params[b])]
    def size(bs: list[int]) -> float:
        return costs.param_bytes(bs, tp, ep) - (0.0 if experts else costs.expert_bytes(bs, ep))

    rest = [size([b]) for b in blocks if b not in root]
    pair = max((rest[k] + rest[k + 1] for k in range(len(rest) - 1)), default=sum(rest))
    mine = size(root) if root else 0.0
    return mine + pair, mine + max(rest, default=0.0)


def _stages(layout: Layout, pp_rank: int) -> list[int]:
    return stages_on(layout.schedule, layout.pp, pp_rank, layout.virtual) if layout.pp > 1 else [0]


def rank_blocks(layout: Layout, balance: list[int], pp_rank: int) -> list[int]:
    """The blocks of the stages at pipeline position `pp_rank`, under the cut `balance`."""
    bounds = [0, *[sum(balance[: k + 1]) for k in range(len(balance))]]
    return [b for s in _stages(layout, pp_rank) for b in range(bounds[s], bounds[s + 1])]


def moments(plan: Plan) -> Moments:
    """Per stage, every (held, past I, grads made) it passes through (module docstring): after
    each of its compute actions, the micro-batches whose F is done and whose B or W is not, how
    many of those are past their I, and 1 once one of its B or W has run (0 before). A plan
    without I and W gives only (n, 0, g)."""
    seen: Moments = {}
    for acts in compute_only(plan).values():
        held: dict[int, int] = {}
        between: dict[int, int] = {}
        made: dict[int, int] = {}
        for a in acts:
            s = a.stage
            step = {F: (1, 0), I: (0, 1), B: (-1, 0), W: (-1, -1)}[a.op]
            held[s], between[s] = held.get(s, 0) + step[0], between.get(s, 0) + step[1]
            made[s] = 1 if a.op in (B, W) else made.get(s, 0)
            seen.setdefault(s, set()).add((held[s], between[s], made[s]))
    return seen


def _held(costs: ModelCosts, layout: Layout, bounds: list[int], s: int) -> float:
    """Bytes per sample stage s holds for one micro-batch's backward (`ModelCosts.held`)."""
    return sum(costs.held(layout.recompute, b, layout.tp) for b in range(bounds[s], bounds[s + 1]))


def _busiest(costs: ModelCosts, layout: Layout, bounds: list[int], s: int, mb: int, most: int,
             grads: float, at: set[tuple[int, int, int]]) -> dict[str, float]:
    """Stage s at its busiest moment (module docstring): `bytes`, its activations, split and
    gradients then; `split`, what its split backward keeps there beyond its `most` held
    micro-batches' activations (0 where no micro-batch is past its I)."""
    mode, tp = costs.modes[layout.recompute], layout.tp
    held = _held(costs, layout, bounds, s) * mb
    if s == 0:  # I does nothing, W all: it keeps the gradient its output received (none if also last)
        last = bounds[1] - 1
        kept = costs.out_bytes[last] * costs.part(last, tp) * mb if len(bounds) > 2 else 0.0
    else:
        kept = sum(mode.kept[b] * costs.part(b, tp) for b in range(bounds[s], bounds[s + 1])) * mb
    split = 0.0
    if any(j for _, j, _ in at):
        split = max(0.0, max(n * held + j * kept for n, j, _ in at) - most * held)
    return {"bytes": max(n * held + j * kept + g * grads for n, j, g in at), "split": split}


def worst(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The rank with the highest peak."""
    return max(per_rank, key=lambda r: r["peak"])
