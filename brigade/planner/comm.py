"""Seconds a collective or a transfer takes, from a cluster's links (no torch import).

The usual bandwidth-optimal ring formulas over n ranks, each sending `bytes` of its own:

    all-reduce        2 (n-1)/n · bytes / bw  +  2 (n-1) · latency
    reduce-scatter      (n-1)/n · bytes / bw  +    (n-1) · latency
    all-gather          (n-1)/n · bytes / bw  +    (n-1) · latency    (bytes: the gathered whole)
    point to point               bytes / bw  +          latency

A group's link is the slowest among its ranks: inter-node when they sit on more than one node.
Ranks are placed as brigade's DeviceMesh orders them, (replicate, shard, pp, tp) with tp innermost
(train/layout.py): rank = ((replica · shard + shard_rank) · pp + stage) · tp + tp_rank.
"""

from __future__ import annotations

from brigade.planner.cluster import Cluster


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


def rank_of(replica: int, shard_rank: int, stage: int, shard: int, pp: int, tp_rank: int = 0,
            tp: int = 1) -> int:
    """The global rank of a (replica, shard rank, pipeline stage, tp rank) position of the mesh."""
    return ((replica * shard + shard_rank) * pp + stage) * tp + tp_rank


def groups(replicate: int, shard: int, pp: int, tp: int = 1) -> dict[str, list[int]]:
    """Rank 0's groups (the slowest are alike by symmetry): its pipeline, its shard group, its
    replicas, its whole data-parallel group (all of stage 0's ranks) and its tp group."""
    def at(r: int, k: int, s: int, t: int = 0) -> int:
        return rank_of(r, k, s, shard, pp, t, tp)

    return {
        "pp": [at(0, 0, s) for s in range(pp)],
        "shard": [at(0, k, 0) for k in range(shard)],
        "replicate": [at(r, 0, 0) for r in range(replicate)],
        "dp": [at(r, k, 0) for r in range(replicate) for k in range(shard)],
        "tp": [at(0, 0, 0, t) for t in range(tp)],
    }
