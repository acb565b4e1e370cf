"""Seconds a collective or a transfer takes, from a cluster's links (no torch import).

The usual bandwidth-optimal ring formulas over n ranks, each sending `bytes` of its own:

    all-reduce        2 (n-1)/n · bytes / bw  +  2 (n-1) · latency
    reduce-scatter      (n-1)/n · bytes / bw  +    (n-1) · latency
    all-gather          (n-1)/n · bytes / bw  +    (n-1) · latency    (bytes: the gathered whole)
    point to point               bytes / bw  +          latency

A group's link is the slowest among its ranks: inter-node when they sit on more than one node.
Ranks are placed as brigade's DeviceMesh orders them (`world.degrees`: replicate, shard, pp, cp,
tp, with tp innermost), so a group's ranks are the world's own.
"""

from __future__ import annotations

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


def groups(replicate: int, shard: int, pp: int, tp: int = 1) -> dict[str, list[int]]:
    """Rank 0's groups (the slowest are alike by symmetry): its pipeline, its shard group, its
    replicas, its whole data-parallel group (all of stage 0's ranks) and its tp group."""
    degrees = Degrees(dp=replicate * shard, shard=shard, pp=pp, tp=tp)
    return {dim: degrees.group(dim, 0) for dim in ("pp", "shard", "replicate", "dp", "tp")}
