"""The ring formulas and which link a group uses."""

import pytest

from brigade.planner import comm
from brigade.planner.cluster import Cluster
from brigade.planner.devices import TABLE


def test_ring_formulas():
    assert comm.all_reduce(8e9, 4, 1e9, 0.0) == pytest.approx(2 * 3 / 4 * 8)
    assert comm.all_reduce(8e9, 4, 1e9, 1e-3) == pytest.approx(12 + 6e-3)
    assert comm.reduce_scatter(8e9, 4, 1e9, 1e-3) == pytest.approx(6 + 3e-3)
    assert comm.all_gather(8e9, 2, 1e9, 0.0) == pytest.approx(4)
    assert comm.p2p(1e9, 1e9, 1e-3) == pytest.approx(1.001)
    assert comm.all_reduce(8e9, 1, 1e9, 1.0) == 0.0  # one rank: nothing to reduce


def test_groups_follow_the_mesh_order_pp_innermost():
    g = comm.groups(replicate=2, shard=2, pp=2)
    assert g == {"pp": [0, 1], "shard": [0, 2], "replicate": [0, 4], "dp": [0, 2, 4, 6], "tp": [0],
                 "ep": [0], "edp": [0, 2, 4, 6], "cp": [0], "dpcp": [0, 2, 4, 6], "fsdp": [0, 2]}
    # expert groups: ep consecutive dp ranks; edp: the dp ranks holding the same experts
    g = comm.groups(replicate=2, shard=2, pp=2, ep=2)
    assert g["ep"] == [0, 2] and g["edp"] == [0, 4]
    # cp between pp and tp: rank = ((shard · 2 + pp) · 2 + cp) · 2 + tp; FSDP2 shards over shard × cp
    g = comm.groups(replicate=1, shard=2, pp=2, tp=2, cp=2)
    assert g["cp"] == [0, 2] and g["tp"] == [0, 1] and g["pp"] == [0, 4]
    assert g["dpcp"] == g["fsdp"] == [0, 2, 8, 10] and g["dp"] == [0, 8]


def test_a_group_across_nodes_takes_the_inter_node_link():
    c = Cluster(2, 4, TABLE["h100"])
    assert comm.link(c, [0, 1, 2, 3]) == (c.device.intra_bw, c.device.intra_latency)
    assert comm.link(c, [0, 4]) == (c.device.inter_bw, c.device.inter_latency)
    # dp 2 × pp 4 on 2 nodes of 4: the pipeline stays in a node, data parallel crosses
    g = comm.groups(2, 1, 4)
    assert comm.link(c, g["pp"])[0] == c.device.intra_bw and comm.link(c, g["dp"])[0] == c.device.inter_bw


def test_a_collective_inside_a_node_runs_at_what_the_device_says_it_achieves():
    from dataclasses import replace

    gloo = replace(TABLE["h100"], all_reduce_bw=1e9, reduce_scatter_bw=3e8, coll_latency=2e-4)
    c = Cluster(2, 4, gloo)
    assert comm.link(c, [0, 1], "all_reduce") == (1e9, 2e-4)
    assert comm.link(c, [0, 1], "reduce_scatter") == (3e8, 2e-4)
    assert comm.link(c, [0, 1], "all_gather") == (gloo.intra_bw, gloo.intra_latency)  # not given: the link's
    assert comm.link(c, [0, 1]) == (gloo.intra_bw, gloo.intra_latency)  # point to point
    assert comm.link(c, [0, 4], "all_reduce") == (gloo.inter_bw, gloo.inter_latency)  # across nodes
