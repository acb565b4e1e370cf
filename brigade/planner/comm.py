"""Seconds a collective or a transfer takes, from a cluster's links (no torch import).

The usual bandwidth-optimal ring formulas over n ranks, each sending `bytes` of its own:

    all-reduce        2 (n-1)/n · bytes / bw  +  2 (n-1) · latency
    reduce-scatter      (n-1)/n · bytes / bw  +    (n-1) · latency
    all-gather          (n-1)/n · bytes / bw  +    (n-1) · latency    (bytes: the gathered whole)
    point to point               bytes / bw  +          latency
    all-to-all          (n-1)/n · bytes, each peer's 1/n on its own link, the node's peers over
                        the fast one and the others' over the slow one at once: the slower of
                        the two  +  (n-1) · the slowest latency   (`all_to_all`)

A group's link is the slowest among its ranks: inter-node when they sit on more than one node.
Ranks are placed as brigade's DeviceMesh orders them (`world.degrees`: replicate, shard, pp, cp,
tp, with tp innermost), so a group's ranks are the world's own.
"""

from __future__ import annotations

import functools

from brigade.planner.cluster import Cluster
from brigade.world.degrees import Degrees


def link(cluster: Cluster, ranks: list[int], kind: str = "") -> tuple[float, float]:
    """(bytes/s, latency) of the slowest link inside a group of ranks; for a collective `kind`
    ("all_reduce", "all_gather", "reduce_scatter") inside one node, what the device says that
    collective achieves where it says so (`DeviceSpec.all_reduce_bw`, ...: gloo on a CPU)."""
    d = cluster.device
    if len({cluster.node_of(r) for r in ranks}) > 1:
        return d.inter_bw, d.inter_latency
    achieved = getattr(d, f"{kind}_bw") if kind else 0.0
    if achieved > 0:
        return achieved, d.coll_latency or d.intra_latency
    return d.intra_bw, d.intra_latency


def all_reduce(nbytes: float, n: int, bw: float, latency: float) -> float:
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * latency


def reduce_scatter(nbytes: float, n: int, bw: float, latency: float) -> float:
    return 0.0 if n <= 1 else (n - 1) / n * nbytes / bw + (n - 1) * latency


def all_gather(nbytes: float, n: int, bw: float, latency: float) -> float:
    return reduce_scatter(nbytes, n, bw, latency)


def p2p(nbytes: float, bw: float, latency: float) -> float:
    return nbytes / bw + latency


def all_to_all(cluster: Cluster, ranks: list[int], nbytes: float) -> float:
    """Seconds of an all-to-all over `ranks` in which each sends `nbytes` of its own, 1/n of them to
    each rank (module docstring), from rank `ranks[0]`'s side: its peers on its node over the
    node's links, the others over the network, both at once."""
    n = len(ranks)
    if n <= 1:
        return 0.0
    d = cluster.device
    home = cluster.node_of(ranks[0])
    near = sum(1 for r in ranks if cluster.node_of(r) == home) - 1
    far = n - 1 - near
    each = nbytes / n
    latency = d.inter_latency if far else d.intra_latency
    return max(near * each / d.intra_bw, far * each / d.inter_bw if far else 0.0) + (n - 1) * latency


def groups(replicate: int, shard: int, pp: int, tp: int = 1, ep: int = 1,
           cp: int = 1) -> dict[str, list[int]]:
    """Rank 0's groups (the slowest are alike by symmetry): its pipeline, its shard group, its
    replicas, its whole data-parallel group (all of stage 0's ranks), its tp group, its expert
    group (ep consecutive dp ranks), the dp ranks holding the same experts (edp), its cp group,
    the processes sharing its stage's weights under cp (dpcp: dp × cp, DDP's group) and those
    FSDP2 shards them over (fsdp: shard × cp, `Degrees.fsdp`; the shard group at cp 1). Each
    list is the caller's own."""
    return {dim: list(ranks) for dim, ranks in _groups(replicate, shard, pp, tp, ep, cp).items()}


@functools.cache
def _groups(replicate: int, shard: int, pp: int, tp: int, ep: int, cp: int) -> dict[str, tuple[int, ...]]:
    """`groups`, computed once per set of degrees: `Degrees.groups` walks every rank of the world,
    and a plan predicts thousands of layouts on a few dozen sets of degrees."""
    degrees = Degrees(dp=replicate * shard, shard=shard, pp=pp, cp=cp, tp=tp, ep=ep)
    out = {dim: tuple(degrees.group(dim, 0))
           for dim in ("pp", "shard", "replicate", "dp", "tp", "ep", "edp", "cp", "dpcp")}
    out["fsdp"] = tuple(sorted(degrees.rank(shard=s, cp=c) for s in range(shard) for c in range(cp)))
    return out
