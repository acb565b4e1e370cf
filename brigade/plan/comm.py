"""Seconds a collective or a transfer takes, from a cluster's links (no torch import).

The usual bandwidth-optimal ring formulas over n ranks, each sending `bytes` of its own:

    all-reduce        2 (n-1)/n · bytes / bw  +  2 (n-1) · latency
    reduce-scatter      (n-1)/n · bytes / bw  +    (n-1) · latency
    all-gather          (n-1)/n · bytes / bw  +    (n-1) · latency    (bytes: the gathered whole)
    point to point               bytes / bw  +          latency

A group's link is the slowest among its ranks: inter-node when they sit on more than one node.
Ranks are placed as brigade's DeviceMesh orders them, (replicate, shard, pp) with pp innermost
(train/layout.py): rank = (replica · shard + shard_rank) · pp + stage.
"""

from __future__ import annotations

from brigade.plan.cluster import Cluster


def link(cluster: Cluster, ranks: list[int]) -> tuple[float, float]:
    """(bytes/s, latency) of the slowest link inside a group of ranks."""
    d = cluster.device
    if len({cluster.node_of(r) for r in ranks}) > 1:
        return d.inter_bw, d.inter_latency
    return d.intra_bw, d.intra_latency


def all_reduce(nbytes: float, n: int, bw: float, latency: float) -> float:
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * latency


def reduce_scatter(nbytes: float, n: int, bw: float, latency: float) -> float:
    return 0.0 if n <= 1 else (n - 1) / n * nbytes / bw + (n - 1) * latency


def all_gather(nbytes: float, n: int, bw: float, latency: float) -> float:
    return reduce_scatter(nbytes, n, bw, latency)


def p2p(nbytes: float, bw: float, latency: float) -> float:
    return nbytes / bw + latency


def rank_of(replica: int, shard_rank: int, stage: int, shard: int, pp: int) -> int:
    """The global rank of a (replica, shard rank, pipeline stage) position of the mesh."""
    return (replica * shard + shard_rank) * pp + stage


def groups(replicate: int, shard: int, pp: int) -> dict[str, list[int]]:
    """Rank 0's groups (the slowest are alike by symmetry): its pipeline, its shard group, its
    replicas, and its whole data-parallel group (all of stage 0's ranks)."""
    return {
        "pp": [rank_of(0, 0, s, shard, pp) for s in range(pp)],
        "shard": [rank_of(0, k, 0, shard, pp) for k in range(shard)],
        "replicate": [rank_of(r, 0, 0, shard, pp) for r in range(replicate)],
        "dp": [rank_of(r, k, 0, shard, pp) for r in range(replicate) for k in range(shard)],
    }
