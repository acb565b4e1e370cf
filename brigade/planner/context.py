"""What context parallel (`--cp C`, `parallel.context`) does to a step's time, and the refusals of
`brigade plan --cp`. Its memory is `planner.memory`'s: a cp process holds every activation of
1/C of each sequence.

    compute     each cp process runs T/C positions of every sequence: every linear part is 1/C,
                and attention, its T/C queries over all T keys (all-to-all: all T positions of
                H/C heads), T²/C of T². So a cp process computes, holds and sends what mb/C whole
                sequences would (`predict`'s `work`): the blocks' costs at mb/C samples, which
                below the smallest measured size are in proportion to it (the smaller kernels'
                lower efficiency on a GPU is not counted)
    all-to-all  per attention call and micro-batch, 4 all-to-alls over the cp group in the
    (Ulysses)   forward (q, k, v, the output) and 4 in the backward (their gradients), and under
                recompute (full or selective: neither keeps a collective's output) the forward's
                4 again before the backward. Each moves what a process holds of that tensor:
                mb/C · T · heads ÷ tp · head dim, k and v at the key/value heads ÷ tp, or at
                the query heads where C does not divide those (the runtime repeats them), (C−1)/C
                of it to the others (`comm.all_to_all`), in half precision where the run is bf16 or
                fp16 (the projections' outputs are half under autocast and FSDP2's mixed precision
                alike), else fp32. On the critical path: added to the block's forward (F), its
                backward (B) and its input pass (I; W sends nothing), and counted as waits, as
                tensor parallel's collectives are
    ring        per attention call and micro-batch, C−1 steps in the forward, each passing one
                part's keys and values (mb/C · T · 2 · K ÷ tp · head dim) to the next process of
                the group (`comm.p2p` on the group's slowest link), and 2 (C−1) in the backward
                (keys and values again, and their gradients), the forward's again under
                recompute. torch's ring overlaps each step's transfer with attention's compute:
                what is counted is what does not hide, max(0, transfer − the block's compute on
                that pass). The whole block's compute stands for attention's: at the lengths
                where cp pays, attention is most of a block (Llama 3.1 8B at 131,072: 71 % of a
                layer's forward FLOPs), so the hiding is slightly favourable at short sequences
    reduction   the processes of a cp group hold the same weights: DDP all-reduces over dp × cp
                ("dpcp"), FSDP2 reduce-scatters and gathers over shard × cp (`Degrees.fsdp`;
                HSDP: then all-reduces over replicas), `reduction.reduction`
    loss        the parts' losses are averaged over cp once a step (`ContextParallel.mean`): one
                small all-reduce (`reduction.step_syncs`)

The method is `--cp-method`: auto is ring on a GPU (a device without a core count: the table's
H100, H200, A100, or a cluster file's) and all-to-all on "cpu", as the runtime picks it
(`parallel.context.method_for`).
"""

from __future__ import annotations

from brigade.errors import BrigadeError
from brigade.parallel.context import method_for
from brigade.planner import comm
from brigade.planner.attention import AttentionFacts
from brigade.planner.cluster import Cluster
from brigade.planner.devices import DeviceSpec
from brigade.planner.memory import rank_blocks
from brigade.planner.space import Layout

RING = "ring"
ALL_TO_ALL = "all-to-all"


def method(name: str, device: DeviceSpec) -> str:
    """The method `--cp-method name` runs on `device` (module docstring).

    Raises:
        BrigadeError: an unknown method, or ring on a CPU.
    """
    return method_for(name, "cpu" if device.cores else "cuda")


def exchanges(attention: AttentionFacts | None, layout: Layout, work: float, cluster: Cluster,
              group: list[int], how: str, half: bool, times: list[tuple[float, ...]],
              waits: list[tuple[float, ...]]):
    """(times, waits, per block the seconds of its exchange a micro-batch): each block's (forward,
    backward, weight, input) seconds and waits with its attention's exchange over the cp `group`
    added by method `how` (module docstring), a process's share being `work` = mb/C sequences;
    `half`: a bf16 or fp16 run. Unchanged, and none, at cp 1 or without attention."""
    if layout.cp == 1 or attention is None:
        return times, waits, [0.0] * len(times)
    size = 2 if half else 4
    again = layout.recompute != "none"
    out, held, per = [], [], []
    for calls, (f, back, w, i), (wf, wb, ww, wi) in zip(attention.calls, times, waits):
        if how == RING:
            fs, bs = _ring(calls, layout, work * size, cluster, group)
            bs += fs if again else 0.0
            fs, bs, is_ = (max(0.0, x - (t - s)) for x, t, s in ((fs, f, wf), (bs, back, wb), (bs, i, wi)))
        else:
            fs = _all_to_all(calls, layout, work * size, cluster, group)
            bs = is_ = fs * (2 if again else 1)
        out.append((f + fs, back + bs, w, i + is_))
        held.append((wf + fs, wb + bs, ww, wi + is_))
        per.append(fs + bs)
    return out, held, per


def _all_to_all(calls, layout: Layout, nbytes: float, cluster: Cluster, group: list[int]) -> float:
    """Seconds of one pass's 4 all-to-alls per call (q, k, v, output, or their gradients);
    `nbytes`: the bytes of an element × the sequences' worth of its part a process holds (mb/C)."""
    t = 0.0
    for c in calls:
        kv = c.kv_at(layout.tp, layout.cp, ring=False)
        q = c.length * c.heads / layout.tp
        for elements in (q * c.head_dim, c.keys * kv * c.head_dim, c.keys * kv * c.value_dim,
                         q * c.value_dim):  # q, k, v, the output (or their gradients)
            t += comm.all_to_all(cluster, group, nbytes * elements)
    return t


def _ring(calls, layout: Layout, nbytes: float, cluster: Cluster, group: list[int]) -> tuple[float, float]:
    """(forward, backward) seconds of the ring's transfers per micro-batch (module docstring)."""
    link = comm.link(cluster, group)
    steps = layout.cp - 1
    one = sum(comm.p2p(nbytes * c.keys * c.kv_at(layout.tp, layout.cp, ring=True)
                       * (c.head_dim + c.value_dim), *link) for c in calls)
    return steps * one, 2 * steps * one


def step_context_s(per_block: list[float], layout: Layout, balance: list[int]) -> float:
    """Seconds of exchange the busiest pipeline rank waits in a step: its blocks' (`per_block`, a
    micro-batch's, from `exchanges`) over every micro-batch."""
    return layout.microbatches * max(sum(per_block[b] for b in rank_blocks(layout, balance, r))
                                     for r in range(layout.pp))


def check_cp(cp: int, world: int, attention: AttentionFacts | None, length: int, how: str, model: str,
             tp: int = 0, ep: int = 0) -> None:
    """Refuse a `brigade plan --cp` the cluster, the model or its sequence cannot take, one line
    each; `tp`, `ep`: the --tp, --ep asked (0: any).

    Raises:
        BrigadeError: a negative --cp; --cp > 1 with a model without attention, not dividing the
            world, with --ep, or that the runtime refuses (`AttentionFacts.refusal`).
    """
    if cp < 0:
        raise BrigadeError(f"--cp {cp}: must be ≥ 0 (0: every degree the sequence and heads allow)")
    if cp <= 1:
        return
    if attention is None:
        raise BrigadeError(f"--cp {cp} but {model} calls no attention (F.scaled_dot_product_attention) whose "
                           "sequence to split: context parallel splits attention's sequences; drop --cp")
    if world % (cp * max(tp, 1)):
        by = f"--cp {cp}" + (f" × --tp {tp}" if tp > 1 else "")
        raise BrigadeError(f"{by} does not divide the cluster's {world} ranks: give a --cp that divides "
                           f"{world // max(tp, 1) if world % max(tp, 1) == 0 else world}")
    if ep > 1:
        raise BrigadeError(f"--cp {cp} with --ep {ep}: context parallel does not compose with expert "
                           "parallel yet; use one of them")
    why = attention.refusal(cp, max(tp, 1), length, how == RING, model)
    if why:
        raise BrigadeError(why)
