"""One layout's predicted step on a cluster: time from `simulate()` over the real plan, the
data-parallel reduction, the optimizer step, tokens/s, MFU, bubble, communication share and each
rank's memory (`memory.py`), and whether it fits.

    step = makespan(plan; per-stage F, B, W, I; P2P)   one pipeline's micro-batches, simulated;
                                                        under tp each block as one tp process
                                                        ran it here (`split_costs`) plus each
                                                        collective it issues at the device's
                                                        price, or elsewhere its split share ÷
                                                        tp plus its all-reduces on the tp link;
                                                        each
                                                        action plus the runtime's own time for
                                                        one (`DeviceSpec.action_s`; more on a
                                                        host with more processes than cores,
                                                        `crowded_action_s`); under ep each
                                                        MoE layer's all-to-alls on its
                                                        block's F, B and I (`expert_parallel`)
         + gradient reduction                           DDP: all-reduce; shard: reduce-scatter and
                                                        the step's all-gather, per block (without
                                                        a pipeline, every micro-batch and a
                                                        second all-gather for the backward); HSDP:
                                                        then an all-reduce of the shard across
                                                        replicas (each at what the device says
                                                        that collective achieves: gloo's probed);
                                                        under ep the experts' apart, over edp
         + FSDP2's own work                             where the costs measured it here
                                                        (`shard_costs`): its copies and hooks per
                                                        block, each gather-reduce cycle
         + optimizer step                               AdamW on this rank's parameters (or shards),
                                                        and under shard or tp what DTensor's
                                                        dispatch adds per parameter
         + the runtime's own time per step              `DeviceSpec.runtime_step_s`
         + the trainer's small collectives              the loss's mean over replicas, the
                                                        gradient norm's sum over tp, shard and
                                                        pp, each weight tied across pipeline
                                                        ranks summed over them (`_step_syncs`)

Not overlapped: an upper bound where a GPU overlaps the reduction with the backward; on a CPU
gloo's collectives take the same cores. Where more processes share a host than it has cores
(`DeviceSpec.cores`), the work is time-shared: compute runs `shared_slowdown` slower with every
core busy, all ranks' compute ÷ the cores is added over what their compute alone would take
(a tp collective's wait for its partner comes on top: it is not compute, and not hidden behind
another rank's), and the reduction, FSDP2's own work and the optimizer step, which every rank
runs at once, take ranks ÷ cores times as long.
"""

from __future__ import annotations

import math
from itertools import accumulate

from brigade.host.cores import shared_cores
from brigade.pipeline.plans.action import Plan
from brigade.pipeline.plans.generate import Costs
from brigade.pipeline.plans.schedule import SCHEDULES, build
from brigade.pipeline.plans.simulate import simulate
from brigade.pipeline.stages.partition import solve
from brigade.planner import comm
from brigade.planner.cluster import Cluster
from brigade.planner.costs import MEASURED, ModelCosts, interpolate
from brigade.planner.expert_parallel import all_to_alls, expert_reduction, step_all_to_all_s
from brigade.planner.memory import HALF, by_block, expert_shard, moments, rank_blocks, rank_memory, worst
from brigade.planner.space import Layout


def predict(
    costs: ModelCosts, layout: Layout, cluster: Cluster, batch: int, seq_len: int, precision: str = "",
    memory_plan: Plan | None = None,
) -> dict:
    """The figures of one layout (module docstring); every figure's `source` is the costs'.
    `memory_plan`: the plan whose memory to predict, when a run holds memory on another plan than
    the one it is timed on (`auto` before it replans; the accuracy benchmark's case).

    Raises:
        PlanError: a schedule that cannot run these sizes (the caller leaves the layout out).
    """
    mb = math.ceil(batch / (layout.dp * layout.microbatches))
    groups = comm.groups(layout.replicate, layout.shard, layout.pp, layout.tp, layout.ep)
    times, waits = _tensor_parallel(costs, layout, mb, cluster, groups["tp"])
    times, waits, a2a = all_to_alls(costs, layout, mb, cluster, groups["ep"], precision in HALF, times, waits)
    balance, per = cut(times, layout.pp * layout.virtual)
    slow = _shared(cluster, layout.world)
    own = _action_s(cluster, layout.world)  # the runtime's own time, per action
    per = [[t * slow + own for t in row] for row in per]
    bw, lat = comm.link(cluster, groups["pp"])
    sent = max((costs.out_bytes[b - 1] * costs.part(b - 1, layout.tp) for b in accumulate(balance[:-1])),
               default=0.0) * mb  # at each cut: a part of the sequence under sequence parallel
    p2p = comm.p2p(sent, bw, lat) if layout.pp > 1 else 0.0
    cores = _pipeline_cores(layout, cluster)
    plan = build(layout.schedule, layout.pp, layout.microbatches, layout.virtual,
                 costed(layout.schedule, per, p2p, cores))
    sim = simulate(plan, per[0], per[1], comm=p2p, weight=per[2], input_grad=per[3])
    alone = simulate(plan, per[0], per[1], weight=per[2], input_grad=per[3]).makespan
    makespan = _on_cores(sim, plan, per, cut(waits, len(balance), balance)[1], slow, cores)
    held = sim.peak_held if memory_plan is None else simulate(memory_plan, 1.0).peak_held
    at = moments(memory_plan or plan)  # under a split backward, what each stage keeps from I to W too
    memory = [rank_memory(costs, layout, balance, held, mb, r, at, precision) for r in range(layout.pp)]
    top = worst(memory)
    reduce_s, opt_s = _after_pipeline(costs, layout, cluster, balance, memory,
                                      by_block(layout, at), precision in HALF)
    sync_s = _step_syncs(costs, layout, cluster, balance, groups)
    step = makespan + reduce_s + opt_s + cluster.device.runtime_step_s + sync_s
    a2a_s = step_all_to_all_s(a2a, layout, balance)
    flops, limit = sum(costs.flops) * batch, cluster.device.memory
    return {
        "layout": layout.to_json(),
        "label": layout.label(),
        "balance": balance,
        "microbatch_size": mb,
        "step_s": step,
        "pipeline_s": makespan,
        "reduce_s": reduce_s,
        "optimizer_s": opt_s,
        "sync_s": sync_s,
        "all_to_all_s": a2a_s,
        "tokens_per_s": batch * max(seq_len, 1) / step,
        "mfu": flops / (step * cluster.device.peak(precision) * layout.world),
        "bubble": sim.bubble_fraction,
        "comm_share": (reduce_s + a2a_s + sim.makespan - alone) / step,
        "memory": top,
        "memory_per_stage_rank": memory,
        "fits": top["peak"] <= limit,
        "over_bytes": max(0.0, top["peak"] - limit),
        "source": costs.source,
    }


def _on_cores(sim, plan: Plan, per: list[list[float]], waits: list[list[float]], slow: float,
              cores: float) -> float:
    """The makespan where a pipeline's ranks share `cores` (`Simulation.on_cores`): the plan's
    makespan, and on top what sharing the cores adds to the ranks' compute (what they compute ÷
    the cores, over their compute's own makespan). Their compute is `per` less its tp
    collectives' `waits` (per stage, as `cut` gives them): a wait is not compute, and it is not
    hidden behind the others' either. Taking the larger of the two, as if a rank's wait let the
    others compute meanwhile, predicted dp 2 × tp 2 on 2 cores 30 % fast and tp 2 × shard 2 21 %
    (with a pipeline, tp 2 × pp 2, 4 % fast); added, in a run just after, 11 % and 4 % fast (and
    14 % slow)."""
    working = [[t - w * slow for t, w in zip(row, wrow)] for row, wrow in zip(per, waits)]
    alone = simulate(plan, working[0], working[1], weight=working[2], input_grad=working[3])
    return sim.makespan + max(0.0, alone.on_cores(cores) - alone.makespan)


def cut(times: list[tuple[float, ...]], n_stages: int,
        balance: list[int] | None = None) -> tuple[list[int], list[list[float]]]:
    """The solver's cut of the blocks into `n_stages` stages, the slowest stage's forward +
    backward as short as it can be (or the given `balance`), and each stage's costs: (balance,
    per) with per[j][s] the sum of cost j (forward, backward, weight, input) over stage s's
    blocks `times`."""
    if balance is None:
        balance = solve([f + b for f, b, *_ in times], n_stages) if n_stages > 1 else [len(times)]
    bounds = [0, *[sum(balance[: k + 1]) for k in range(n_stages)]]
    per = [[sum(c[j] for c in times[a:b]) for a, b in zip(bounds, bounds[1:])] for j in range(4)]
    return balance, per


def costed(schedule: str, per: list[list[float]], p2p: float, cores: float) -> Costs | None:
    """What a costed schedule (`auto`) is planned on, as the runtime plans it: these per-stage
    costs (`cut`), the transfer and the shared cores; None for the other schedules."""
    if not SCHEDULES[schedule].costed:
        return None
    return Costs(tuple(per[0]), tuple(per[3]), tuple(per[2]), backward=tuple(per[1]), comm=p2p, cores=cores)


def _after_pipeline(costs: ModelCosts, layout: Layout, cluster: Cluster, balance: list[int],
                    memory: list[dict], blockwise: bool, half: bool) -> tuple[float, float]:
    """(seconds of the gradient reduction and FSDP2's own work on it, of the optimizer step)
    after the pipeline's makespan, on the busiest rank; where more processes than cores share a
    host, every rank runs these at once and they take turns (`_crowding`): gloo's copies and
    sums and FSDP2's own work are compute on the shared cores, block by block through the step
    as much as at its end. `blockwise`: FSDP gathers and reduces each block every micro-batch
    (`memory.by_block`); `half`: it gathers half-precision weights. (Counted uncrowded, as
    waits that leave the core to another rank, HSDP 2 × 2 on 2 cores read 16-25 % fast once
    FSDP2's own work was priced apart, `shard_costs`.)"""
    groups = comm.groups(layout.replicate, layout.shard, layout.pp, layout.tp, layout.ep)
    blocks = [rank_blocks(layout, balance, r) for r in range(layout.pp)]
    # each pp rank's experts, unsharded, where they are reduced apart from the dense weights (ep > 1)
    experts = [costs.expert_bytes(bs, layout.ep) if layout.ep > 1 else 0.0 for bs in blocks]
    # the dense weights' whole gradient: the rank's own less its experts' share, times the shard
    whole_grads = max((m["grads"] - x / expert_shard(layout)) * layout.shard for m, x in zip(memory, experts))
    reduce_s = _reduction(cluster, layout, groups, whole_grads, 1 + max(map(len, blocks)), blockwise, half)
    reduce_s += max(expert_reduction(costs, cluster, layout, groups, bs, x, blockwise, half)
                    for bs, x in zip(blocks, experts))
    own_s = _fsdp_own(costs, layout, blocks, blockwise)
    opt_s = costs.optimizer_s_per_byte * costs.mem_scale * worst(memory)["params"]
    if layout.shard > 1 or layout.tp > 1 or layout.ep > 1:  # DTensor parameters: each op dispatches
        count = max(len({p for b in bs for p in costs.params[b]}) for bs in blocks)
        opt_s += cluster.device.dtensor_step_s * count
    crowd = _crowding(layout, cluster)
    return (reduce_s + own_s) * crowd, opt_s * crowd


def _step_syncs(costs: ModelCosts, layout: Layout, cluster: Cluster, balance: list[int],
                groups: dict) -> float:
    """Seconds of the small collectives the trainer issues once a step beside the pipeline's: the
    loss's mean over replicas (`ProcessModel._dp_mean`), the gradient norm's sum of squares over
    each of tp, shard and pp (`ProcessModel.grad_norm`), and each weight tied across pipeline
    ranks summed over the ranks that hold a copy, shard by shard (`Assembly.settle_grads`).
    Latency, nearly all: about 0.5-1 ms each on gloo, where `examples/llama.py`'s pp 2 step
    (30 ms, a tied head) spent 2-2.5 ms in its norm's and its tie's."""
    def all_reduce(nbytes: float, n: int, group: list[int]) -> float:
        return comm.all_reduce(nbytes, n, *comm.link(cluster, group, "all_reduce"))

    t = all_reduce(4, layout.dp, groups["dp"])
    t += sum(all_reduce(4, n, groups[dim]) for dim, n in
             (("tp", layout.tp), ("shard", layout.shard), ("pp", layout.pp)))
    if layout.ep > 1:  # the experts' norm over their group (`experts.norm_group`), the plans' proof
        t += all_reduce(4, layout.ep, groups["ep"]) + all_reduce(16, layout.dp, groups["dp"])
    holders: dict[int, set[int]] = {}  # parameter id -> the pipeline ranks holding a copy
    nbytes: dict[int, int] = {}
    for r in range(layout.pp):
        for b in rank_blocks(layout, balance, r):
            for pid, n in costs.params[b].items():
                holders.setdefault(pid, set()).add(r)
                nbytes[pid] = n
    return t + sum(all_reduce(nbytes[pid] / layout.shard, len(ranks), groups["pp"])
                   for pid, ranks in holders.items() if len(ranks) > 1)


def _fsdp_own(costs: ModelCosts, layout: Layout, blocks: list[list[int]], blockwise: bool) -> float:
    """Seconds of FSDP2's own work (its copies around each collective, its hooks) on the busiest
    pipeline rank: each of its blocks' measured cycle (`shard_costs`), every micro-batch where
    it gathers and reduces blockwise, else once a step; 0 unsharded, or where not measured on
    this machine (on a GPU FSDP2 copies on its own streams)."""
    if layout.shard == 1 or not costs.shard_s or costs.source != MEASURED:
        return 0.0
    times = layout.microbatches if blockwise else 1
    return times * max(sum(costs.shard_s[b] for b in bs) for bs in blocks)


def _tensor_parallel(costs: ModelCosts, layout: Layout, mb: int, cluster: Cluster,
                     group: list[int]) -> tuple[list[tuple[float, ...]], list[tuple[float, ...]]]:
    """(times, waits): each block's (forward, backward, weight, input) seconds on one of the
    layout's tp processes, and of those the seconds its collectives take; tp 1's and none at tp 1.
    Where the costs were measured on one tp process at this degree on this machine
    (`split_costs`) and the device prices a collective as DTensor issues it: those times, and
    each collective the block's forward issues on F, each of its backward's on B and on I (W
    sends nothing), at that price plus its bytes (the block's whole output, gathered). Else the
    split share ÷ tp, and per row-wise layer one all-reduce of the block's output in the forward
    and one of its input gradient in the backward (the Megatron-LM pattern)."""
    times = costs.block_times(layout.recompute, mb)
    tp = layout.tp
    if tp == 1:
        return times, [(0.0,) * 4 for _ in times]
    split = costs.modes[layout.recompute].split
    each = _tp_collective_s(cluster, layout.world)
    if split is not None and split.tp == tp and costs.source == MEASURED and each:
        bw, _ = comm.link(cluster, group, "all_gather")
        out, waits = [], []
        for b, (f, back, w, i) in enumerate(interpolate(split.times, mb)):
            nf, nb = split.collectives[b]
            one = each + comm.all_gather(costs.out_bytes[b] * mb, tp, bw, 0.0)
            out.append((f + nf * one, back + nb * one, w, i + nb * one))
            waits.append((nf * one, nb * one, 0.0, nb * one))
        return out, waits
    link = comm.link(cluster, group, "all_reduce")
    out, waits = [], []
    for b, (f, back, w, i) in enumerate(times):
        k = costs.tp_factor(b, tp)
        pairs = costs.tensor.pairs[b] if costs.tensor is not None else 0
        reduce = pairs * comm.all_reduce(costs.out_bytes[b] * mb, tp, *link)
        out.append((f * k + reduce, back * k + reduce, w * k, i * k + reduce))
        waits.append((reduce, reduce, 0.0, reduce))
    return out, waits


def _tp_collective_s(cluster: Cluster, world: int) -> float:
    """Seconds one tensor-parallel collective adds as DTensor issues it (0: the device does not
    say): where a host has more processes than cores, the crowded figure (a wait for the partner
    to get a core: `predict` counts it in the makespan, not in the work the ranks share the
    cores for)."""
    d = cluster.device
    crowded = d.cores and min(world, cluster.per_node) > d.cores and d.crowded_tp_collective_s
    return d.crowded_tp_collective_s if crowded else d.tp_collective_s


def _pipeline_cores(layout: Layout, cluster: Cluster) -> float:
    """The cores a pipeline's ranks share where a host has more processes than cores, in ranks'
    worth (`generate.Costs.cores`; each of a rank's tp processes needs a core of its own); 0 on a
    device without a core count (a GPU). `Simulation.on_cores` of it: the makespan, or at least
    every rank's work on the host ÷ its cores."""
    if not cluster.device.cores:
        return 0.0
    procs = min(layout.world, cluster.per_node)
    return shared_cores(layout.pp, procs, cores=cluster.device.cores)


def _crowding(layout: Layout, cluster: Cluster) -> float:
    """How much longer the step's other phases (reduction, optimizer) take where a host has more
    ranks than cores: every rank runs them at once, so they share the cores (1: not crowded)."""
    procs = min(layout.world, cluster.per_node)
    cores = cluster.device.cores
    return procs / cores if cores and procs > cores else 1.0


def _action_s(cluster: Cluster, world: int) -> float:
    """The runtime's own seconds per action: more where a host has more processes than cores (a
    rank woken by its neighbour's transfer waits for a core), where the device says how much."""
    d = cluster.device
    crowded = d.cores and min(world, cluster.per_node) > d.cores and d.crowded_action_s
    return d.crowded_action_s if crowded else d.action_s


def _shared(cluster: Cluster, world: int) -> float:
    """How much slower compute runs when `world`'s ranks share a host's cores (1: not shared)."""
    d = cluster.device
    busy = min(world, cluster.per_node)
    if not d.cores or busy <= 1:
        return 1.0
    return 1 + (d.shared_slowdown - 1) * (min(busy, d.cores) - 1) / max(d.cores - 1, 1)


def _reduction(cluster: Cluster, layout: Layout, groups: dict, grads: float, units: int,
               blockwise: bool = False, half: bool = False) -> float:
    """Seconds of one step's gradient reduction (and a sharded stage's parameter all-gather). A
    sharded stage reduces and gathers each of its `units` (fully_shard per block, then the
    stage's root) in a collective of its own: the bytes are the same, the latency `units` times;
    under a pipeline once a step, gathered once; `blockwise` (no pipeline) every micro-batch,
    gathered twice (for its forward and again for its backward). The gradients are reduced in
    fp32; the weights gathered in half precision where `half`."""
    if layout.dp == 1:
        return 0.0
    if layout.shard == 1:
        return comm.all_reduce(grads, layout.dp, *comm.link(cluster, groups["dp"], "all_reduce"))
    each = grads / units
    gathers, times = (2, layout.microbatches) if blockwise else (1, 1)
    t = comm.reduce_scatter(each, layout.shard, *comm.link(cluster, groups["shard"], "reduce_scatter"))
    t += gathers * comm.all_gather(each * (0.5 if half else 1.0), layout.shard,
                                   *comm.link(cluster, groups["shard"], "all_gather"))
    t += comm.all_reduce(each / layout.shard, layout.replicate,
                         *comm.link(cluster, groups["replicate"], "all_reduce"))
    return units * times * t
