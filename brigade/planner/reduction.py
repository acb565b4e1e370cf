"""What a step does after its pipeline's makespan (`predict`'s module docstring): the gradient
reduction, with a sharded stage's all-gather, over the processes holding the same weights (dp × cp
under DDP, shard × cp under FSDP2, `memory.shards`), and the experts' apart over edp; FSDP2's own
work where measured here; the optimizer step; and the trainer's small collectives once a step. All
on the busiest rank and crowded where a host has more processes than cores; not overlapped with the
backward on a CPU (gloo's collectives take the same cores), overlapped on a GPU without a pipeline
(`exposed`).
"""

from __future__ import annotations

from brigade.planner import comm
from brigade.planner.cluster import Cluster
from brigade.planner.costs import MEASURED, ModelCosts
from brigade.planner.expert_parallel import expert_reduction
from brigade.planner.memory import expert_shard, rank_blocks, shards, worst
from brigade.planner.space import Layout


def after_pipeline(costs: ModelCosts, layout: Layout, cluster: Cluster, balance: list[int],
                   memory: list[dict], blockwise: bool, half: bool, compute_s: float = 0.0) -> tuple[float, float]:
    """(seconds of the gradient reduction and FSDP2's own work on it, of the optimizer step)
    after the pipeline's makespan, on the busiest rank; where more processes than cores share a
    host, every rank runs these at once and they take turns (`crowding`): gloo's copies and
    sums and FSDP2's own work are compute on the shared cores, block by block through the step
    as much as at its end. `blockwise`: FSDP gathers and reduces each block every micro-batch
    (`memory.by_block`); `half`: it gathers half-precision weights. (Counted uncrowded, as
    waits that leave the core to another rank, HSDP 2 × 2 on 2 cores read 16-25 % fast once
    FSDP2's own work was priced apart, `shard_costs`.) `compute_s`: the step's compute, which the
    reduction runs beside on a GPU without a pipeline (`exposed`)."""
    groups = comm.groups(layout.replicate, layout.shard, layout.pp, layout.tp, layout.ep, layout.cp)
    blocks = [rank_blocks(layout, balance, r) for r in range(layout.pp)]
    # each pp rank's experts, unsharded, where they are reduced apart from the dense weights (ep > 1)
    experts = [costs.expert_bytes(bs, layout.ep) if layout.ep > 1 else 0.0 for bs in blocks]
    # the dense weights' whole gradient: the rank's own less its experts' share, times the shard
    whole_grads = max((m["grads"] - x / expert_shard(layout)) * shards(layout)
                      for m, x in zip(memory, experts))
    units = 1 + max(map(len, blocks))
    reduce_s = reduction(cluster, layout, groups, whole_grads, units, blockwise, half)
    if not cluster.device.cores and layout.pp == 1:
        reduce_s = exposed(reduce_s, compute_s, units)
    reduce_s += max(expert_reduction(costs, cluster, layout, groups, bs, x, blockwise, half)
                    for bs, x in zip(blocks, experts))
    own_s = _fsdp_own(costs, layout, blocks, blockwise)
    opt_s = costs.optimizer_s_per_byte * costs.mem_scale * worst(memory)["params"]
    if shards(layout) > 1 or layout.tp > 1 or layout.ep > 1:  # DTensor parameters: each op dispatches
        count = max(len({p for b in bs for p in costs.params[b]}) for bs in blocks)
        opt_s += cluster.device.dtensor_step_s * count
    crowd = crowding(layout, cluster)
    return (reduce_s + own_s) * crowd, opt_s * crowd


def exposed(reduce_s: float, compute_s: float, units: int) -> float:
    """The seconds of a GPU's gradient reduction (and FSDP2's gathers) that its compute does not hide.

    Without a pipeline a GPU runs DDP's bucketed all-reduces, and FSDP2's per-block all-gathers
    (the next block's prefetched while this one computes) and reduce-scatters, on their own
    streams beside the forward and backward: one unit's share (`reduce_s` ÷ `units`: the first
    block's gather, the last one's reduction) has nothing to hide behind, the rest hides behind
    the compute but where it takes longer than it."""
    alone = reduce_s / max(units, 1)
    return alone + max(reduce_s - alone - compute_s, 0.0)


def step_syncs(costs: ModelCosts, layout: Layout, cluster: Cluster, balance: list[int],
               groups: dict) -> float:
    """Seconds of the small collectives the trainer issues once a step beside the pipeline's: the
    loss's mean over replicas (`ProcessModel._dp_mean`) and over cp (`ContextParallel.mean`), the
    gradient norm's sum of squares over each of tp, the shards (shard × cp where FSDP2 shards over
    cp too) and pp (`ProcessModel.grad_norm`), and each weight tied across pipeline
    ranks summed over the ranks that hold a copy, shard by shard (`Assembly.settle_grads`).
    Latency, nearly all: about 0.5-1 ms each on gloo, where `examples/llama.py`'s pp 2 step
    (30 ms, a tied head) spent 2-2.5 ms in its norm's and its tie's."""
    def all_reduce(nbytes: float, n: int, group: list[int]) -> float:
        return comm.all_reduce(nbytes, n, *comm.link(cluster, group, "all_reduce"))

    t = all_reduce(4, layout.dp, groups["dp"]) + all_reduce(4, layout.cp, groups["cp"])
    t += sum(all_reduce(4, n, groups[dim]) for dim, n in
             (("tp", layout.tp), ("fsdp", shards(layout)), ("pp", layout.pp)))
    if layout.ep > 1:  # the experts' norm over their group (`experts.norm_group`), the plans' proof
        t += all_reduce(4, layout.ep, groups["ep"]) + all_reduce(16, layout.dp, groups["dp"])
    holders: dict[int, set[int]] = {}  # parameter id -> the pipeline ranks holding a copy
    nbytes: dict[int, int] = {}
    for r in range(layout.pp):
        for b in rank_blocks(layout, balance, r):
            for pid, n in costs.params[b].items():
                holders.setdefault(pid, set()).add(r)
                nbytes[pid] = n
    return t + sum(all_reduce(nbytes[pid] / shards(layout), len(ranks), groups["pp"])
                   for pid, ranks in holders.items() if len(ranks) > 1)


def _fsdp_own(costs: ModelCosts, layout: Layout, blocks: list[list[int]], blockwise: bool) -> float:
    """Seconds of FSDP2's own work (its copies around each collective, its hooks) on the busiest
    pipeline rank: each of its blocks' measured cycle (`shard_costs`), every micro-batch where
    it gathers and reduces blockwise, else once a step; 0 unsharded, or where not measured on
    this machine (on a GPU FSDP2 copies on its own streams)."""
    if shards(layout) == 1 or not costs.shard_s or costs.source != MEASURED:
        return 0.0
    times = layout.microbatches if blockwise else 1
    return times * max(sum(costs.shard_s[b] for b in bs) for bs in blocks)


def crowding(layout: Layout, cluster: Cluster) -> float:
    """How much longer the step's other phases (reduction, optimizer) take where a host has more
    ranks than cores: every rank runs them at once, so they share the cores (1: not crowded)."""
    procs = min(layout.world, cluster.per_node)
    cores = cluster.device.cores
    return procs / cores if cores and procs > cores else 1.0


def reduction(cluster: Cluster, layout: Layout, groups: dict, grads: float, units: int,
              blockwise: bool = False, half: bool = False) -> float:
    """Seconds of one step's gradient reduction (and a sharded stage's parameter all-gather), over
    the processes holding the same weights: DDP all-reduces over dp × cp, FSDP2 reduce-scatters and
    gathers over shard × cp (`memory.shards`), then HSDP all-reduces over replicas. A sharded
    stage reduces and gathers each of its `units` (fully_shard per block, then the stage's root)
    in a collective of its own: the bytes are the same, the latency `units` times; under a
    pipeline once a step, gathered once; `blockwise` (no pipeline) every micro-batch, gathered
    twice (for its forward and again for its backward). The gradients are reduced in fp32; the
    weights gathered in half precision where `half`."""
    if layout.dp * layout.cp == 1:
        return 0.0
    n = shards(layout)
    if n == 1:  # DDP, over the processes holding the same weights: dp × cp
        link = comm.link(cluster, groups["dpcp"], "all_reduce")
        return comm.all_reduce(grads, layout.dp * layout.cp, *link)
    each = grads / units
    gathers, times = (2, layout.microbatches) if blockwise else (1, 1)
    t = comm.reduce_scatter(each, n, *comm.link(cluster, groups["fsdp"], "reduce_scatter"))
    t += gathers * comm.all_gather(each * (0.5 if half else 1.0), n,
                                   *comm.link(cluster, groups["fsdp"], "all_gather"))
    t += comm.all_reduce(each / n, layout.replicate,
                         *comm.link(cluster, groups["replicate"], "all_reduce"))
    return units * times * t
