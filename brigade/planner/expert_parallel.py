"""What expert parallel (`--ep`, `parallel.experts`) adds to a step's time: the all-to-alls that
take each MoE layer's tokens to their experts and back, and the experts' gradient reduction over
the processes holding the same experts (edp = dp/ep) instead of all of dp.

    all-to-alls   per MoE layer and micro-batch: in its forward the experts' row counts (E
                  numbers) and two of rows (to the experts, back), in its backward the two rows'
                  reversed, and where recompute runs the forward again (full; selective too, which
                  keeps neither the experts' grouped matmuls nor a collective) the forward's three
                  again. Each process sends its rows' share for the others: tokens × top_k × C
                  (`mixture.Mixture.rows`) × (ep−1)/ep, in bf16 under FSDP2's mixed precision
                  and fp32 otherwise (autocast leaves the normed rows the experts take in fp32),
                  over the expert group's links (`comm.all_to_all`: ep consecutive dp ranks, in
                  one node while ep × pp × tp fits one). They lie on the stage's critical path:
                  added to the block's forward (F), its backward (B) and its input pass (I), as
                  tensor parallel's collectives are (`predict._tensor_parallel`), and counted as
                  waits, not compute, where ranks share cores
    reduction     DDP leaves the experts out and they are all-reduced over edp by hand (one flat
                  buffer); sharded, each MoE layer's experts are an FSDP2 unit over edp: a
                  reduce-scatter and an all-gather each (per micro-batch and gathered twice
                  without a pipeline), as `reduction.reduction` prices the dense units

Balanced routing is assumed (`planner.mixture`): each process sends and receives as many rows as
its own tokens chose; an imbalanced router's busiest process waits for more.
"""

from __future__ import annotations

from brigade.planner import comm
from brigade.planner.cluster import Cluster
from brigade.planner.costs import ModelCosts
from brigade.planner.memory import rank_blocks
from brigade.planner.space import Layout

COUNT_BYTES = 8  # one int64 an expert: the counts' all-to-all


def all_to_all_count(layers: int, recompute: str) -> tuple[int, int]:
    """(in a forward, in a backward) the row all-to-alls of `layers` MoE layers per micro-batch
    (module docstring)."""
    return 2 * layers, 2 * layers + (2 * layers if recompute != "none" else 0)


def all_to_alls(costs: ModelCosts, layout: Layout, mb: int, cluster: Cluster, group: list[int], half: bool,
                times: list[tuple[float, ...]], waits: list[tuple[float, ...]]):
    """(times, waits, per block the seconds of its all-to-alls a micro-batch): each block's
    (forward, backward, weight, input) seconds and waits with its MoE layers' all-to-alls over
    the expert group `group` added (module docstring), at micro-batch size `mb`; `half`: a bf16 or
    fp16 run, whose rows travel in half precision where the stages are sharded (FSDP2's mixed
    precision). Unchanged, and none, at ep 1 or without experts."""
    mix = costs.mixture
    if layout.ep == 1 or mix is None:
        return times, waits, [0.0] * len(times)
    half = half and layout.degrees.sharded
    count = comm.all_to_all(cluster, group, max(mix.counts) * COUNT_BYTES)
    out, held, per = [], [], []
    for b, ((f, back, w, i), (wf, wb, ww, wi)) in enumerate(zip(times, waits)):
        n = mix.layers[b]
        row = comm.all_to_all(cluster, group, mix.rows[b] / n * mb * (2 if half else 4)) if n else 0.0
        forward, backward = all_to_all_count(n, layout.recompute)
        fs = forward * row + n * count
        bs = backward * row + (n * count if layout.recompute != "none" else 0.0)
        out.append((f + fs, back + bs, w, i + bs))
        held.append((wf + fs, wb + bs, ww, wi + bs))
        per.append(fs + bs)
    return out, held, per


def step_all_to_all_s(per_block: list[float], layout: Layout, balance: list[int]) -> float:
    """Seconds of all-to-alls the busiest pipeline rank waits in a step: its blocks' (`per_block`,
    a micro-batch's, from `all_to_alls`) over every micro-batch."""
    return layout.microbatches * max(sum(per_block[b] for b in rank_blocks(layout, balance, r))
                                     for r in range(layout.pp))


def expert_reduction(costs: ModelCosts, cluster: Cluster, layout: Layout, groups: dict, blocks: list[int],
                     nbytes: float, blockwise: bool, half: bool) -> float:
    """Seconds of the experts' gradient reduction of one pipeline rank holding `blocks`, whose
    experts are `nbytes` unsharded (module docstring); `blockwise`: FSDP gathers and reduces every
    micro-batch, `half`: it gathers bf16 weights. 0 where one process holds its experts alone."""
    edp = layout.dp // layout.ep
    if not nbytes or edp == 1:
        return 0.0
    if not layout.degrees.sharded:
        return comm.all_reduce(nbytes, edp, *comm.link(cluster, groups["edp"], "all_reduce"))
    units = sum(costs.mixture.layers[b] for b in blocks)
    each = nbytes / units
    gathers, times = (2, layout.microbatches) if blockwise else (1, 1)
    t = comm.reduce_scatter(each, edp, *comm.link(cluster, groups["edp"], "reduce_scatter"))
    t += gathers * comm.all_gather(each * (0.5 if half else 1.0), edp,
                                   *comm.link(cluster, groups["edp"], "all_gather"))
    return units * times * t
