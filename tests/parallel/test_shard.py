"""FSDP2 on a stage from outside (brigade/parallel/shard.py) and its one reduction per step.

Two processes share a pipeline sharded over both: the gradients equal one device's on the whole
batch under a plain and a split backward, and FSDP's collectives are counted. With one stage (no
pipeline) FSDP runs its own way: each unit gathered for each micro-batch's forward (and again for
its backward with `reshard`) and reduce-scattered after each backward. With two stages on the rank
(a pipeline) the runtime holds the reduction for the step: an all-gather per unit per step (per
micro-batch with `reshard`), one reduce-scatter per unit per step, not per micro-batch.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from brigade.parallel.shard import _shared_within, shard_stage

M = 4  # micro-batches


def _stage() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(6, 8), nn.Tanh()), nn.Linear(8, 5), nn.Linear(5, 3))


def _loss(out, y):
    return ((out - y) ** 2).mean()


def _counting(calls: dict):
    """Wrap torch.distributed's single-tensor all-gather and reduce-scatter (FSDP2's) to count them."""
    for name in ("all_gather_single", "reduce_scatter_single"):
        real = getattr(dist, name)

        def counted(*args, _real=real, _name=name, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kw)
        setattr(dist, name, counted)


def _joined():
    """Join the 2-process world; (rank, one device's stage after a backward on the whole batch,
    the same stage untouched, the batch)."""
    from brigade.launcher import groups

    groups.init("gloo", threads=1)
    ref, stage = _stage(), _stage()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
    _loss(ref(x), y).backward()
    return dist.get_rank(), ref, stage, x, y


def _one_step(schedule: str, reshard: bool, stages: int) -> dict:
    """Worker: one step of a sharded pipeline of `stages` stages (1, or 2 on this one rank) over 2
    ranks; the worst gradient difference from one device and the collectives of the step."""
    from torch.distributed.device_mesh import init_device_mesh

    from brigade.dtensors import full
    from brigade.launcher import groups
    from brigade.pipeline.pipe import Pipeline

    rank, ref, stage, x, y = _joined()
    mesh = init_device_mesh("cpu", (2,))
    parts = {0: stage} if stages == 1 else {0: stage[:2], 1: stage[2:]}
    for part in parts.values():
        shard_stage(part, mesh, reshard=reshard)
    solo = dist.new_group([rank])  # the pipeline's own group: this rank alone
    pipe = Pipeline(parts, schedule, M, _loss, group=solo, device=torch.device("cpu"),
                    virtual=stages if stages > 1 else 0)
    calls: dict = {}
    _counting(calls)
    pipe.step(x.chunk(2)[rank], y.chunk(2)[rank])
    worst = max((full(p.grad) - q.grad).abs().max().item()
                for p, q in zip(stage.parameters(), ref.parameters()))
    sharded = all(type(p).__name__ == "DTensor" and p.to_local().shape[0] <= (q.shape[0] + 1) // 2
                  for p, q in zip(stage.parameters(), ref.parameters()))
    groups.destroy()
    return {"worst": worst, "calls": calls, "sharded": sharded}


UNITS = 3  # the three blocks (the Tanh block's Linear is in its block); the roots hold no parameter


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reshard", [False, True])
@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_without_a_pipeline_fsdp_reduces_each_backward_and_gradients_of_one_device(schedule, reshard):
    from brigade import launch

    got = launch(_one_step, 2, schedule, reshard, 1)[0]
    assert got["worst"] < 1e-6 and got["sharded"], got
    assert got["calls"]["reduce_scatter_single"] == UNITS * M, got  # every micro-batch's backward
    # gathered for every forward (freed after each backward); with reshard again for each backward
    assert got["calls"]["all_gather_single"] == UNITS * M * (2 if reshard else 1), got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reshard", [False, True])
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_under_a_pipeline_one_reduce_scatter_per_unit_per_step_and_gradients_of_one_device(schedule, reshard):
    from brigade import launch

    got = launch(_one_step, 2, schedule, reshard, 2)[0]
    assert got["worst"] < 1e-6 and got["sharded"], got
    assert got["calls"]["reduce_scatter_single"] == UNITS, got
    gathers = got["calls"]["all_gather_single"]
    assert gathers == UNITS if not reshard else gathers > UNITS, got


def test_a_parameter_two_blocks_share_is_left_to_the_stage():
    shared = nn.Linear(3, 3)
    blocks = [nn.Sequential(shared), nn.Linear(3, 3), nn.Sequential(shared, nn.ReLU())]
    assert _shared_within(blocks) == {id(shared.weight), id(shared.bias)}
    assert _shared_within([nn.Linear(2, 2), copy.deepcopy(nn.Linear(2, 2))]) == set()


def _dtypes(calls: dict):
    """Wrap the single-tensor all-gather and reduce-scatter to record the dtypes they move."""
    for name in ("all_gather_single", "reduce_scatter_single"):
        real = getattr(dist, name)

        def seen(output, input, *args, _real=real, _name=name, **kw):
            calls.setdefault(_name, set()).add(input.dtype)
            return _real(output, input, *args, **kw)
        setattr(dist, name, seen)


def _mixed_step(schedule: str) -> dict:
    """Worker: one bf16 step of the sharded one-stage pipeline (FSDP2's mixed precision): the
    dtypes the blocks compute with and the collectives move, the shards' and gradients' dtypes,
    and the worst gradient difference from one fp32 device, relative to the largest gradient."""
    from torch.distributed.device_mesh import init_device_mesh

    from brigade.dtensors import full
    from brigade.launcher import groups
    from brigade.pipeline.pipe import Pipeline

    rank, ref, stage, x, y = _joined()
    shard_stage(stage, init_device_mesh("cpu", (2,)), param_dtype=torch.bfloat16)
    computed = set()
    stage[1].register_forward_pre_hook(lambda m, args: computed.update({m.weight.dtype, args[0].dtype}))
    pipe = Pipeline({0: stage}, schedule, M, _loss, group=dist.new_group([rank]), device=torch.device("cpu"))
    moved: dict = {}
    _dtypes(moved)
    loss = pipe.step(x.chunk(2)[rank], y.chunk(2)[rank])
    top = max(q.grad.abs().max().item() for q in ref.parameters())
    worst = max((full(p.grad) - q.grad).abs().max().item()
                for p, q in zip(stage.parameters(), ref.parameters())) / top
    kept = {str(p.dtype) for p in stage.parameters()} | {str(p.grad.dtype) for p in stage.parameters()}
    groups.destroy()
    return {"computed": sorted(map(str, computed)), "loss": str(loss.dtype), "kept": sorted(kept),
            "moved": {k: sorted(map(str, v)) for k, v in moved.items()}, "worst": worst}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_bf16_under_sharding_gathers_bf16_and_keeps_fp32_shards_and_reductions(schedule):
    from brigade import launch

    got = launch(_mixed_step, 2, schedule)[0]
    assert got["computed"] == ["torch.bfloat16"], got  # the gathered weight and the input
    assert got["moved"] == {"all_gather_single": ["torch.bfloat16"],
                            "reduce_scatter_single": ["torch.float32"]}, got
    assert got["kept"] == ["torch.float32"] and got["loss"] == "torch.float32", got
    assert got["worst"] < 2e-2, got  # bf16's 8 bits of mantissa, against one fp32 device
