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
                                                        block's F, B and I (`expert_parallel`);
                                                        under cp each process's mb/cp
                                                        sequences' worth, plus attention's
                                                        all-to-alls, or the ring's transfers
                                                        that its compute does not hide, on
                                                        F, B and I (`context`)
         + gradient reduction                           DDP: all-reduce (over dp × cp); shard
                                                        (over shard × cp, `memory.shards`):
                                                        reduce-scatter and the step's
                                                        all-gather, per block (without a
                                                        pipeline, every micro-batch and a
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
         + the trainer's small collectives              the loss's mean over replicas and
                                                        over cp, the gradient norm's sum over
                                                        tp, the shards and pp, each weight tied
                                                        across pipeline ranks summed over them
                                                        (`reduction.step_syncs`)

On a CPU not overlapped: gloo's collectives take the same cores. On a GPU without a pipeline the
reduction runs beside the compute and only what the compute cannot hide counts
(`reduction.exposed`); under a pipeline it is counted whole after the makespan (an upper bound). Where more processes share a host than it has cores
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
from brigade.pipeline.plans.action import W, Plan
from brigade.pipeline.plans.costs import Costs
from brigade.pipeline.plans.schedule import SCHEDULES, build
from brigade.pipeline.plans.simulate import simulate
from brigade.pipeline.stages.partition import solve
from brigade.planner import comm
from brigade.planner.cluster import Cluster
from brigade.planner.context import exchanges, method, step_context_s
from brigade.planner.costs import MEASURED, ModelCosts, interpolate
from brigade.planner.expert_parallel import all_to_alls, step_all_to_all_s
from brigade.planner.memory import HALF, by_block, moments, rank_memory, worst
from brigade.planner.reduction import after_pipeline, step_syncs
from brigade.planner.reserve import outside, reserved
from brigade.planner.space import Layout


def _memory(costs: ModelCosts, layout: Layout, cluster: Cluster, balance, held, work: float, at,
            precision: str) -> tuple[list[dict], dict, float]:
    """Each pipeline rank's memory, the busiest's (with what the allocator reserves for it,
    `reserve`), and all the busiest process holds: that and NCCL's own buffers."""
    memory = [rank_memory(costs, layout, balance, held, work, r, at, precision) for r in range(layout.pp)]
    top = worst(memory)
    top["reserved"] = reserved(top["peak"], cluster.device)  # as the allocator holds it (`reserve`)
    return memory, top, top["reserved"] + outside(layout, cluster.device)


def predict(
    costs: ModelCosts, layout: Layout, cluster: Cluster, batch: int, seq_len: int, precision: str = "",
    memory_plan: Plan | None = None, cp_method: str = "auto",
) -> dict:
    """The figures of one layout (module docstring); every figure's `source` is the costs'.
    `memory_plan`: the plan whose memory to predict, when a run holds memory on another plan than
    the one it is timed on (`auto` before it replans; the accuracy benchmark's case). `cp_method`:
    how attention exchanges under cp (`context.method`). A plan with weight passes (a split
    backward) is predicted on `costs.unchunked` where there are such: training chunks no loss there.

    Raises:
        PlanError: a schedule that cannot run these sizes (the caller leaves the layout out).
    """
    mb = math.ceil(batch / (layout.dp * layout.microbatches))
    work = mb / layout.cp if layout.cp > 1 else mb  # a cp process: mb/cp sequences' worth (`context`)
    groups = comm.groups(layout.replicate, layout.shard, layout.pp, layout.tp, layout.ep, layout.cp)
    times, waits, a2a, ctx = _per_block(costs, layout, mb, work, cluster, groups, precision, cp_method)
    balance, per = cut(times, layout.pp * layout.virtual)
    slow, own = _shared(cluster, layout.world), _action_s(cluster, layout.world)  # own: the runtime's, per action
    per = [[t * slow + own for t in row] for row in per]
    p2p = _p2p(costs, layout, balance, work, cluster, groups["pp"])
    cores = _pipeline_cores(layout, cluster)
    plan = build(layout.schedule, layout.pp, layout.microbatches, layout.virtual,
                 costed(layout.schedule, per, p2p, cores))
    if costs.unchunked is not None and any(a.op == W for acts in plan.values() for a in acts):
        return predict(costs.unchunked, layout, cluster, batch, seq_len, precision, memory_plan, cp_method)
    sim = simulate(plan, per[0], per[1], comm=p2p, weight=per[2], input_grad=per[3])
    alone = simulate(plan, per[0], per[1], weight=per[2], input_grad=per[3]).makespan
    makespan = _on_cores(sim, plan, per, cut(waits, len(balance), balance)[1], slow, cores)
    held = sim.peak_held if memory_plan is None else simulate(memory_plan, 1.0).peak_held
    at = moments(memory_plan or plan)  # under a split backward, what each stage keeps from I to W too
    memory, top, held_all = _memory(costs, layout, cluster, balance, held, work, at, precision)
    reduce_s, opt_s = after_pipeline(costs, layout, cluster, balance, memory,
                                      by_block(layout, at), precision in HALF, makespan)
    sync_s = step_syncs(costs, layout, cluster, balance, groups)
    step = makespan + reduce_s + opt_s + cluster.device.runtime_step_s + sync_s
    a2a_s, cp_s = step_all_to_all_s(a2a, layout, balance), step_context_s(ctx, layout, balance)
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
        "context_s": cp_s,
        "tokens_per_s": batch * max(seq_len, 1) / step,
        "mfu": flops / (step * cluster.device.peak(precision) * layout.world),
        "bubble": sim.bubble_fraction,
        "comm_share": (reduce_s + a2a_s + cp_s + sim.makespan - alone) / step,
        "memory": top,
        "memory_per_stage_rank": memory,
        "fits": held_all <= limit,
        "over_bytes": max(0.0, held_all - limit),
        "source": costs.source,
    }


def _per_block(costs: ModelCosts, layout: Layout, mb: int, work: float, cluster: Cluster, groups: dict,
               precision: str, cp_method: str):
    """(times, waits, a2a, ctx): each block's (forward, backward, weight, input) seconds on one
    process of the layout at micro-batch size `mb` (`work`: what a cp process computes, mb/cp),
    and of those the seconds its collectives take, with tp's (`_tensor_parallel`), ep's
    (`expert_parallel.all_to_alls`) and cp's (`context.exchanges`); and per block a micro-batch's
    ep all-to-alls and cp exchange in seconds."""
    half = precision in HALF
    times, waits = _tensor_parallel(costs, layout, work, cluster, groups["tp"])
    times, waits, a2a = all_to_alls(costs, layout, mb, cluster, groups["ep"], half, times, waits)
    times, waits, ctx = exchanges(costs.attention, layout, work, cluster, groups["cp"],
                                  method(cp_method, cluster.device), half, times, waits)
    return times, waits, a2a, ctx


def _p2p(costs: ModelCosts, layout: Layout, balance: list[int], work: float, cluster: Cluster,
         group: list[int]) -> float:
    """Seconds of one pipeline message (0 without a pipeline): the largest output at a cut, a
    part of the sequence under sequence parallel and under cp, `work` sequences' worth."""
    if layout.pp == 1:
        return 0.0
    sent = max((costs.out_bytes[b - 1] * costs.part(b - 1, layout.tp) for b in accumulate(balance[:-1])),
               default=0.0) * work
    return comm.p2p(sent, *comm.link(cluster, group))


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
    worth (`plans.costs.Costs.cores`; each of a rank's tp processes needs a core of its own); 0 on a
    device without a core count (a GPU). `Simulation.on_cores` of it: the makespan, or at least
    every rank's work on the host ÷ its cores."""
    if not cluster.device.cores:
        return 0.0
    procs = min(layout.world, cluster.per_node)
    return shared_cores(layout.pp, procs, cores=cluster.device.cores)




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

