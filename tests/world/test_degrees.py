"""`Degrees`: every degree checked in one place, rank ↔ coordinates, and every group's ranks (pure)."""

from __future__ import annotations

import itertools

import pytest

from brigade.errors import BrigadeError
from brigade.world.degrees import DIMS, Degrees

GRID = [Degrees(dp=dp, shard=shard, pp=pp, cp=cp, tp=tp, ep=ep)
        for dp, shard, pp, cp, tp, ep in itertools.product((1, 2, 4), (1, 2), (1, 3), (1, 2), (1, 2), (1, 2))
        if dp % shard == 0 and dp % ep == 0]


@pytest.mark.parametrize("d", GRID, ids=str)
def test_every_rank_has_its_own_coordinates_and_back(d):
    seen = set()
    for r in range(d.size):
        c = d.coords(r)
        seen.add(tuple(getattr(c, dim) for dim in DIMS))
        assert d.rank(**{dim: getattr(c, dim) for dim in DIMS}) == r
        assert d.rank(dp=c.dp, pp=c.pp, cp=c.cp, tp=c.tp) == r  # dp stands for replicate and shard
        assert c.dp == c.replicate * d.shard + c.shard and c.ep == c.dp % d.ep
    assert len(seen) == d.size == d.dp * d.pp * d.cp * d.tp


def test_the_documented_order_tp_innermost_then_cp_then_pp():
    d = Degrees(dp=4, shard=2, pp=2)  # rank = (replicate · 2 + shard) · 2 + pp
    assert [(d.coords(r).replicate, d.coords(r).shard, d.coords(r).pp) for r in range(8)] == \
        [(a, b, c) for a in range(2) for b in range(2) for c in range(2)]
    d = Degrees(dp=2, pp=2, cp=2, tp=2)  # rank = ((dp · 2 + pp) · 2 + cp) · 2 + tp
    assert d.rank(dp=1, pp=0, cp=1, tp=1) == 11 and d.coords(6) == d.coords(6).__class__(0, 0, 1, 1, 0, 0, 0)


@pytest.mark.parametrize("d", GRID, ids=str)
def test_groups_partition_the_world_and_differ_in_their_own_coordinates_only(d):
    for dim in (*DIMS, "dp", "ep", "edp"):
        groups = d.groups(dim)
        assert sorted(r for g in groups for r in g) == list(range(d.size))
        sizes = {"dp": d.dp, "ep": d.ep, "edp": d.dp // d.ep, "replicate": d.replicate}
        size = sizes.get(dim) or getattr(d, dim)
        assert all(len(g) == size for g in groups), dim
        along = {"dp": ("replicate", "shard"), "ep": ("replicate", "shard"),
                 "edp": ("replicate", "shard")}.get(dim, (dim,))
        for g in groups:
            rest = {tuple(getattr(d.coords(r), x) for x in DIMS if x not in along) for r in g}
            assert len(rest) == 1, (dim, g)
            assert d.group(dim, g[-1]) == g


def test_groups_come_in_rank_order_of_the_other_coordinates_and_expert_groups_are_consecutive_dp_ranks():
    d = Degrees(dp=4, pp=2, tp=2, ep=2)
    assert d.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert d.groups("dp")[0] == [0, 4, 8, 12]
    assert d.groups("ep")[:2] == [[0, 4], [8, 12]]  # dp ranks 0, 1 and 2, 3 of pp 0, tp 0
    assert d.groups("edp")[:2] == [[0, 8], [4, 12]]  # dp ranks 0, 2 (each its group's first) and 1, 3
    for r in range(d.size):  # an expert group and an edp group meet in one rank
        assert set(d.group("ep", r)) & set(d.group("edp", r)) == {r}


@pytest.mark.parametrize("degrees,world,message", [
    (Degrees(dp=0), None, "--dp 0: must be ≥ 1"),
    (Degrees(tp=-1), None, "--tp -1: must be ≥ 1"),
    (Degrees(dp=2, shard=3), None,
     "--shard 3 does not divide the data-parallel width dp 2: give --shard a divisor of 2 (dp = --shard × "
     "replicas; 1: no sharding)"),
    (Degrees(dp=4, ep=3), None,
     "--ep 3 does not divide the data-parallel width dp 4: give --ep a divisor of 4 (dp = --ep × expert "
     "groups; 1: none)"),
    (Degrees(dp=2, pp=2), 2,
     "--dp 2 × --pp 2 = 4 but the world size is 2: the world size must equal dp × pp"),
    (Degrees(dp=1, pp=2, tp=2), 8,
     "--dp 1 × --pp 2 × --tp 2 = 4 but the world size is 8: the world size must equal dp × pp × tp"),
])
def test_check_refuses_in_one_line(degrees, world, message):
    with pytest.raises(BrigadeError) as got:
        degrees.check(world)
    assert str(got.value) == message


@pytest.mark.parametrize("world,given,message", [
    (3, dict(tp=2), "--tp 2 does not divide the world size 3 (here): make the world a multiple of --tp"),
    (6, dict(pp=2, tp=2),
     "world size 6 (here) is not divisible by --pp 2 × --tp 2 = 4: make it a multiple of the pipeline stages "
     "× --tp"),
    (4, dict(pp=3),
     "world size 4 (here) is not divisible by --pp 3: make it a multiple of the pipeline stages"),
    (4, dict(dp=1, pp=2),
     "--dp 1 × --pp 2 = 2 but the world size is 4 (here): the world size must equal dp × pp, or not"),
])
def test_derive_refuses_in_one_line(world, given, message):
    with pytest.raises(BrigadeError) as got:
        Degrees.derive(world, where=" (here)", hint=", or not", **given)
    assert str(got.value) == message


def test_derive_fills_dp_from_the_world():
    assert Degrees.derive(8, pp=2, tp=2) == Degrees(dp=2, pp=2, tp=2)
    assert Degrees.derive(8, shard=2, pp=2).replicate == 2
    assert Degrees.derive(4, dp=4) == Degrees(dp=4)


def test_a_rank_or_coordinate_outside_the_world_is_refused():
    d = Degrees(dp=2, pp=2)
    with pytest.raises(ValueError):
        d.coords(4)
    with pytest.raises(ValueError):
        d.rank(pp=2)
    with pytest.raises(ValueError):
        d.groups("sp")


@pytest.mark.parametrize("degrees,sharded", [
    (Degrees(dp=2, shard=2), True), (Degrees(dp=4, shard=2), True), (Degrees(dp=2, tp=2), True),
    (Degrees(dp=2), False), (Degrees(pp=2, tp=2), False), (Degrees(), False),
])
def test_sharded_is_fsdp2s_layouts_shard_or_tensor_parallel_with_replicas(degrees, sharded):
    assert degrees.sharded is sharded
