"""`planner.shard_costs`: what FSDP2's own work adds to each block, measured in this process on a
world whose other process is not there: each block sharded as training shards a stage, timed in
turn with the block whole."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from brigade.models.gpt import GPTConfig, gpt, gpt_loss
from brigade.planner import shard_costs
from brigade.world.mesh import fake_world


def _blocks():
    torch.manual_seed(0)
    return gpt(GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=8))


def _timed(seen):
    """An `_in_turn` that records what it was given and says the sharded one took 3 ms more, or
    (the third block) 1 ms less: noise, read as nothing added."""

    def fake(modules, h, loss_fn, y, repeats):
        seen.append((modules, h, loss_fn))
        return [0.010, 0.009] if len(seen) == 3 else [0.010, 0.013]

    return fake


def test_each_block_is_sharded_as_a_stage_of_its_own_and_timed_against_itself_whole(monkeypatch):
    seen = []
    monkeypatch.setattr(shard_costs, "_in_turn", _timed(seen))
    blocks = _blocks()
    x, y = torch.randint(0, 96, (2, 8)), torch.randint(0, 96, (2, 8))
    with fake_world(2) as mesh:
        got = shard_costs.measure_shard(blocks, x, y, gpt_loss, None, mesh, repeats=1)
    assert not dist.is_initialized()  # the fake world is gone again
    assert got == pytest.approx([0.003, 0.003, 0.0, 0.003])
    for k, (modules, _, loss_fn) in enumerate(seen):
        whole, sharded = modules
        # the block's own unit under a root, as `shard_stage` wraps a stage's blocks and the stage
        assert isinstance(sharded, FSDPModule) and isinstance(sharded.block, FSDPModule)
        assert all(type(p).__name__ == "DTensor" for p in sharded.parameters())
        assert not any(type(p).__name__ == "DTensor" for p in whole.parameters())
        assert (loss_fn is gpt_loss) == (k == len(blocks) - 1)  # the head's loss, as training's
    assert seen[1][1].shape == (2, 8, 32)  # each block on the whole blocks' output before it
    # the blocks given stay as they were: measured on copies
    assert not any(type(p).__name__ == "DTensor" for b in blocks for p in b.parameters())


def test_a_half_precision_run_gathers_its_shards_into_that_dtype(monkeypatch):
    seen = []
    monkeypatch.setattr(shard_costs, "_in_turn", _timed(seen))
    blocks = _blocks()
    with fake_world(2) as mesh:
        shard_costs.measure_shard(blocks, torch.randint(0, 96, (2, 8)), torch.randint(0, 96, (2, 8)),
                                  gpt_loss, torch.bfloat16, mesh, repeats=1)
    whole, sharded = seen[1][0]
    assert {p.dtype for p in whole.parameters()} == {torch.bfloat16}  # the whole block timed in bf16
    assert {p.dtype for p in sharded.parameters()} == {torch.float32}  # fp32 shards (the masters)
    assert seen[1][1].dtype == torch.bfloat16
    with fake_world(2):  # the sharded block computes in bf16: FSDP2's mixed precision
        out = sharded(seen[1][1])
    assert out.dtype == torch.bfloat16


def test_a_block_without_parameters_costs_fsdp_nothing():
    with fake_world(2) as mesh:
        got = shard_costs.measure_shard([torch.nn.ReLU(), torch.nn.Linear(4, 4)], torch.randn(2, 4), None,
                                        None, None, mesh, repeats=1)
    assert got[0] == 0.0 and len(got) == 2 and got[1] >= 0.0
