"""`World`: the one DeviceMesh, its groups and sub-meshes, against `Degrees` (4 processes on gloo),
a world of one without a process group, and a local stage's group on its own GPU (no GPU needed)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from brigade.errors import BrigadeError
from brigade.launcher import agent, groups
from brigade.world.degrees import Degrees
from brigade.world.mesh import World

DIMS = ("replicate", "shard", "pp", "cp", "tp", "dp", "dpcp")  # every group the worlds have
WORLDS = [Degrees(dp=4), Degrees(dp=4, shard=2, ep=2), Degrees(dp=2, pp=2), Degrees(pp=2, tp=2),
          Degrees(dp=2, shard=2, tp=2), Degrees(cp=2, tp=2), Degrees(dp=2, cp=2)]


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def worlds_worker() -> dict:
    """Per degrees: this rank's coordinates, every group's ranks, the shard and tp meshes' ranks."""
    info = groups.init(threads=1)
    out = {}
    for d in WORLDS:
        world = World(d, info.device)
        got = {"coords": world.coords, "stream": world.stream, "place": world.place,
               "shard_mesh": sorted(world.shard_mesh.mesh.flatten().tolist()),
               "tp_mesh": world.tp_mesh.mesh.flatten().tolist()}
        for dim in DIMS + (("ep", "edp") if d.ep > 1 else ()):
            got[dim] = _ranks(world.group(dim))
        out[str(d)] = got
    try:
        World(Degrees(dp=2, pp=3), info.device)
    except BrigadeError as exc:
        out["error"] = str(exc)
    groups.destroy()
    return out


@pytest.fixture(scope="module")
def launched() -> dict:
    return agent.launch(worlds_worker, 4)


@pytest.mark.xdist_group("world-4proc")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("d", WORLDS, ids=str)
def test_every_group_and_mesh_is_the_degrees_group(launched, d):
    for rank, got in launched.items():
        case = got[str(d)]
        assert case["coords"] == d.coords(rank)
        for dim in DIMS + (("ep", "edp") if d.ep > 1 else ()):
            assert case[dim] == d.group(dim, rank), (dim, rank)
        assert case["tp_mesh"] == d.group("tp", rank)
        # FSDP2's mesh: HSDP's is 2-D; under cp the data mesh's shard × cp (and its replicas)
        shard_over = "shard" if d.replicate == 1 and d.cp == 1 else "dpcp"
        assert case["shard_mesh"] == sorted(d.group(shard_over, rank))
        assert case["stream"] == rank // d.tp  # the tp processes of a stage share one
        assert case["place"].startswith(f"dp{d.coords(rank).dp} pp{d.coords(rank).pp}")


@pytest.mark.xdist_group("world-4proc")
@pytest.mark.timeout(300)
def test_degrees_that_are_not_the_world_are_refused(launched):
    errors = [got["error"] for got in launched.values()]
    assert all(e.startswith("--dp 2 × --pp 3 = 6 but the world size is 4") for e in errors)


def test_a_world_of_one_needs_no_process_group():
    assert not dist.is_initialized()
    world = World(Degrees(), torch.device("cpu"), ["cpu", "cpu"])
    assert world.local and world.group("pp") is None and world.coords.dp == 0
    with pytest.raises(BrigadeError, match=r"^--dp 2 × --pp 1 = 2 but the world size is 1"):
        World(Degrees(dp=2), torch.device("cpu"))


def test_one_local_stage_is_still_a_local_pipeline():
    """`--runtime local --stages 1`: one device given, and the process still drives it itself."""
    assert World(Degrees(), torch.device("cpu"), ["cpu"]).local
    assert not World(Degrees(), torch.device("cpu")).local


TWO_REPLICAS = SimpleNamespace(degrees=Degrees(dp=2), rank=0)  # what `World.stage_group` reads


def test_a_stage_group_is_not_created_on_a_bound_default_group(monkeypatch):
    default = SimpleNamespace(bound_device_id=torch.device("cuda", 0))
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: default)
    with pytest.raises(BrigadeError, match=r"^the process group is bound to cuda:0 but this process "
                                           r"drives several GPUs: pass local_stages"):
        World.stage_group(TWO_REPLICAS, torch.device("cuda", 1))


def test_a_stage_group_is_bound_to_its_own_gpu(monkeypatch):
    made = []
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group",
                        lambda: SimpleNamespace(bound_device_id=None))
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: made.append((ranks, kw)) or "g")
    assert World.stage_group(TWO_REPLICAS, torch.device("cuda", 3)) == "g"
    assert made == [([0, 1], {"device_id": torch.device("cuda", 3)})]
