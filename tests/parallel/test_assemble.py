"""The one stage assembler: the cut, the wrappers in their one order, what a process holds, and that
`brigade train` and `brigade check` both build their stages with it (no process group needed:
the world is a stand-in with the degrees and coordinates a real one would have)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from brigade.parallel import assemble as assembler
from brigade.parallel.assemble import ORDER, Cut, OwnedBlocks, assemble
from brigade.world.degrees import Degrees

CPU = torch.device("cpu")


def blocks(n: int = 4) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(3, 3), nn.Tanh()) for _ in range(n)]


class _Mesh(str):
    """A named stand-in for a DeviceMesh: its name, and its size."""

    def size(self) -> int:
        return 2


def world(degrees: Degrees, rank: int = 0, devices=None) -> SimpleNamespace:
    """What `assemble` asks of a `world.World`, for `rank` of `degrees`."""
    devices = devices or [CPU]
    return SimpleNamespace(degrees=degrees, coords=degrees.coords(rank), rank=rank, device=devices[0],
                           devices=devices, local=len(devices) > 1, tp_mesh=_Mesh("tp mesh"),
                           shard_mesh="shard mesh", group=lambda dim: f"{dim} group", cp_mesh="cp mesh",
                           stage_group=lambda d: f"group on {d}", tie_ranks=lambda: degrees.groups("pp"))


def test_a_cut_names_each_stages_blocks_and_its_stages_per_rank():
    cut = Cut((2, 1, 1, 2), (0, 1, 1, 0))  # a V over 2 ranks
    assert [list(cut.blocks(s)) for s in range(4)] == [[0, 1], [2], [3], [4, 5]]
    assert cut.virtual == 2


def test_owned_names_blocks_by_global_index():
    bs = blocks()
    owned = OwnedBlocks(bs, [1, 3])
    names = dict(owned.named_parameters())
    assert set(names) == {f"blocks.{i}.0.{p}" for i in (1, 3) for p in ("weight", "bias")}
    assert names["blocks.3.0.weight"] is bs[3][0].weight  # the blocks themselves, not copies
    assert set(owned.state_dict()) == set(names)


@pytest.fixture
def calls(monkeypatch) -> list[tuple[str, object]]:
    """Every wrapper `assemble` applies, in the order it applies them."""
    seen: list[tuple[str, object]] = []
    monkeypatch.setattr(assembler.fp8, "convert", lambda blocks, recipe, sharded, held:
                        seen.append(("float8", recipe)))
    monkeypatch.setattr(assembler.tensor, "parallelize",
                        lambda held, mesh, sequence=True: seen.append(("tensor parallel", mesh)))
    real = assembler.recompute.apply
    monkeypatch.setattr(assembler.recompute, "apply",
                        lambda bs, mode, held=None: seen.append(("recompute", mode)) or real(bs, mode, held))
    monkeypatch.setattr(assembler.context, "ContextParallel", lambda group, mesh, method: f"cp {method}")
    monkeypatch.setattr(assembler.context, "apply", lambda bs, held, cp, parts, tp: seen.append(
        ("context parallel", cp)))
    monkeypatch.setattr(assembler.lora, "apply",
                        lambda bs, held, spec, float8: seen.append(("lora", spec.rank)))
    monkeypatch.setattr(assembler.experts, "split_experts", lambda held, world: seen.append(
        ("expert parallel", world.degrees.ep)))
    real_compile = assembler.compiled.compile_blocks
    monkeypatch.setattr(assembler.compiled, "compile_blocks", lambda bs, held, modes: seen.append(
        ("compile", sorted(held))) or real_compile(bs, held, modes))
    monkeypatch.setattr(assembler, "shard_stage",
                        lambda module, mesh, reshard, mixed:
                        seen.append(("shard or replicate", mesh)) or module)
    monkeypatch.setattr(assembler, "data_parallel",
                        lambda module, group, ids, ignore=(): seen.append(("shard or replicate", group))
                        or module)
    return seen


def test_the_wrappers_come_in_their_one_order(calls):
    """float8, tensor parallel, context parallel, recompute, LoRA, expert parallel, compile, then
    sharding: ORDER, written once, is what runs (float8 and LoRA refuse each other in a run:
    `lora.check_with`, its own test)."""
    from brigade.parallel.lora import LoraSpec

    w = world(Degrees(dp=2, shard=2, pp=2, cp=2, tp=2), rank=4)  # dp rank 0, pp rank 1, cp 0, tp 0
    built = assemble(blocks(), Cut((2, 2), (0, 1)), w, recompute_mode="full", compile=True,
                     float8="rowwise", adapters=LoraSpec(4))
    assert [what for what, _ in calls] == list(ORDER)
    assert calls == [("float8", "rowwise"), ("tensor parallel", "tp mesh"),
                     ("context parallel", "cp all-to-all"), ("recompute", "full"), ("lora", 4),
                     ("expert parallel", 1), ("compile", [2, 3]), ("shard or replicate", "shard mesh")]
    assert sorted(built.held) == [2, 3] and list(built.stages) == [1]  # pipeline rank 1: stage 1
    assert built.modes == ["full"] * 4


@pytest.mark.parametrize("degrees,wrapper", [
    (Degrees(dp=2), "dpcp group"),                # replicas: DDP over dp × cp (the dp group at cp 1)
    (Degrees(cp=2), "dpcp group"),                # a sequence's parts: DDP over them
    (Degrees(dp=2, shard=2), "shard mesh"),       # sharded: FSDP2 over the shard mesh
    (Degrees(dp=2, tp=2), "shard mesh"),          # DTensors: FSDP2 replicates, at shard 1 too
    (Degrees(pp=2), None),                        # no replicas: nothing wraps the stage
])
def test_a_stage_with_replicas_is_sharded_or_replicated(calls, degrees, wrapper):
    assemble(blocks(), Cut((2, 2), (0, 1)), world(degrees))
    assert [w for what, w in calls if what == "shard or replicate"] == ([wrapper] if wrapper else [])


@pytest.mark.parametrize("degrees,local,under,mixed", [
    (Degrees(dp=2, shard=2), False, None, torch.bfloat16),   # sharded: FSDP2's mixed precision
    (Degrees(dp=2, tp=2), False, None, torch.bfloat16),      # FSDP2 over tp's replicas too
    (Degrees(dp=2), False, torch.bfloat16, None),            # DDP: autocast over fp32 weights
    (Degrees(pp=2, tp=2), False, torch.bfloat16, None),      # no replicas: autocast
    (Degrees(dp=2), True, torch.bfloat16, None),             # local stages: autocast
])
def test_bf16_is_fsdp2_mixed_precision_where_sharded_and_autocast_elsewhere(degrees, local, under, mixed):
    w = world(degrees, devices=[CPU, CPU] if local else None)
    assert assembler.precision(w, torch.bfloat16) == (under, mixed)
    assert assembler.precision(w, None) == (None, None)  # fp32: neither


def test_a_sharded_stage_is_handed_the_runs_precision(monkeypatch):
    got = []
    monkeypatch.setattr(assembler, "shard_stage",
                        lambda module, mesh, reshard, mixed: got.append(mixed) or module)
    w = world(Degrees(dp=2, shard=2, pp=2))
    built = assemble(blocks(), Cut((2, 2), (0, 1)), w, autocast=torch.float16)
    assert got == [torch.float16] and built.autocast is None and built.mixed == torch.float16


def test_local_stages_sit_on_their_devices_each_with_a_group_of_its_own(calls):
    w = world(Degrees(dp=2), devices=[CPU, torch.device("meta")])  # 2 local stages, dp 2
    built = assemble(blocks(), Cut((1, 1, 1, 1), (0, 1, 1, 0)), w)  # V = 2
    assert sorted(built.stages) == [0, 1, 2, 3] and sorted(built.held) == [0, 1, 2, 3]
    assert [g for what, g in calls if what == "shard or replicate"] == \
        ["group on cpu", "group on meta", "group on meta", "group on cpu"]
    assert {p.device.type for p in built.stages[1].parameters()} == {"meta"}


def test_train_and_check_build_their_stages_with_the_one_assembler(monkeypatch):
    """`brigade check` proves what `brigade train` runs because both call `assemble`."""
    from brigade.check import run as check_run
    from brigade.check.config import CheckConfig
    from brigade.config import ParallelConfig
    from brigade.train import process_model
    from brigade.world.mesh import World

    seen = []

    def spy(*args, **kwargs):
        seen.append(args[1])  # the cut
        return assemble(*args, **kwargs)

    monkeypatch.setattr(check_run, "assemble", spy)
    monkeypatch.setattr(process_model, "assemble", spy)
    check_run.run_case(CheckConfig(model="toy", stages=2, runtime="local", batch_size=4, microbatches=2),
                       ("1f1b", 2, 0))
    two_devices = World(Degrees(), CPU, [CPU, CPU])  # local stages in this process
    cfg = ParallelConfig(dp=1, local_stages=2)
    engine = process_model.ProcessModel(blocks(), nn.functional.mse_loss, cfg, two_devices)
    engine.close()
    assert [c.ranks for c in seen] == [(0, 1), (0, 1)]
