"""This process's part of the model, directly: its world's place and groups, owned blocks and their
names, the one-process engine.

Most cases run in this process in a one-rank gloo group; one 2-process launch checks the
rank mapping, the groups and the owned blocks' names of both dp × pp shapes of a world of 2,
and `replan` under auto (a 4-process dp 2 × pp 2 case would also pin row- against column-major
order, at twice the cost; the trainer's dp2xpp2 equivalence test covers that layout end to end).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from brigade.config import ParallelConfig
from brigade.errors import BrigadeError
from brigade.launcher import agent, groups
from brigade.pipeline.plans.costs import Costs
from brigade.train.process_model import ProcessModel, by_device, world_of

CPU = torch.device("cpu")
N_BLOCKS = 4
WIDTH = 3


def make_blocks(n: int = N_BLOCKS) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(n)]


def batch(n: int = 6):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)


@pytest.fixture(scope="module")
def world1():
    """A one-rank gloo group in this process (torn down after the module)."""
    assert not dist.is_initialized(), "another test left a process group behind"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    groups.destroy()


# by_device needs no process group.

def test_by_device_groups_in_first_seen_order():
    a, c = torch.zeros(1), torch.zeros(2)
    b, d = torch.zeros(1, device="meta"), torch.zeros(3, device="meta")
    groups = by_device([a, b, c, d])
    assert [[id(t) for t in g] for g in groups] == [[id(a), id(c)], [id(b), id(d)]]
    assert by_device([]) == []


# world_of in a one-rank group.

def test_world_of_a_single_process(world1):
    world = world_of(ParallelConfig(dp=1, pp=1), CPU)
    d, c = world.degrees, world.coords
    assert (d.dp, d.pp, c.dp, c.pp) == (1, 1, 0, 0)
    assert dist.get_world_size(world.group("dp")) == dist.get_world_size(world.group("pp")) == 1
    assert world.device == CPU and not world.local


@pytest.mark.parametrize("dp,pp", [(2, 1), (1, 3)])
def test_world_of_refuses_a_shape_that_is_not_the_world(world1, dp, pp):
    with pytest.raises(BrigadeError, match=rf"^--dp {dp} × --pp {pp} = {dp * pp} but the world size is 1"):
        world_of(ParallelConfig(dp=dp, pp=pp), CPU)


def test_local_stages_refuse_a_group_bound_to_another_gpu(monkeypatch):
    """LOCAL_RANK 1 with 2 local stages drives cuda:2 and cuda:3, not the cuda:1 of one GPU each."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(BrigadeError, match=r"^the process group is bound to cuda:1 but stage 0 of "
                                           r"--local-stages 2 runs on cuda:2: pass local_stages=2"):
        world_of(ParallelConfig(dp=2, local_stages=2), torch.device("cuda", 1))


# ProcessModel with pp = 1, dp = 1: the plain model's loss and gradients.

@pytest.fixture
def engine_and_reference(world1):
    blocks = make_blocks()
    reference = nn.Sequential(*copy.deepcopy(blocks))
    cfg = ParallelConfig(dp=1, pp=1, microbatches=4)
    engine = ProcessModel(blocks, nn.functional.mse_loss, cfg, world_of(cfg, CPU))
    yield engine, reference
    engine.close()


def reference_step(reference: nn.Module, scale: float = 1.0) -> torch.Tensor:
    x, y = batch()
    loss = nn.functional.mse_loss(reference(x), y)
    (loss * scale).backward()
    return loss.detach()


def paired(engine: ProcessModel, reference: nn.Module):
    """(engine parameter, reference parameter, name) for every parameter, matched by name."""
    mine = dict(engine.owned.named_parameters())
    ref = {f"blocks.{name}": p for name, p in reference.named_parameters()}
    assert mine.keys() == ref.keys()  # layout-free names: blocks.<global index>.…
    return [(mine[n], ref[n], n) for n in mine]


def test_engine_step_equals_the_plain_model(engine_and_reference):
    engine, reference = engine_and_reference
    loss = engine.forward_backward(*batch(), loss_scale=1.0, sync=True)
    torch.testing.assert_close(loss, reference_step(reference))
    for p, q, name in paired(engine, reference):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert len(engine.grads()) == len(list(reference.parameters()))


def test_engine_loss_scale_scales_gradients_not_the_loss(engine_and_reference):
    engine, reference = engine_and_reference
    loss = engine.forward_backward(*batch(), loss_scale=0.25, sync=True)
    torch.testing.assert_close(loss, reference_step(reference, scale=0.25))
    for p, q, name in paired(engine, reference):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_engine_grad_norm_is_clip_grad_norms(engine_and_reference):
    engine, reference = engine_and_reference
    engine.forward_backward(*batch(), loss_scale=1.0, sync=True)
    reference_step(reference)
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
    torch.testing.assert_close(engine.grad_norm(), want)


def test_a_weight_tied_across_local_stages_has_a_copy_per_stage(world1):
    """Block 3 reuses block 0's weight; two local stages: one copy each, both holding the
    one-device gradient, counted once in the norm, stored under one name."""
    blocks = make_blocks()
    blocks[3][0].weight = blocks[0][0].weight
    reference = nn.Sequential(*copy.deepcopy(blocks))  # one deepcopy keeps the tie
    cfg = ParallelConfig(dp=1, pp=1, local_stages=2, microbatches=2, balance="2,2")
    engine = ProcessModel(blocks, nn.functional.mse_loss, cfg, world_of(cfg, CPU))
    try:
        assert blocks[3][0].weight is not blocks[0][0].weight  # untied: each stage its own
        assert engine.owned.aliases == {"blocks.3.0.weight": "blocks.0.0.weight"}
        loss = engine.forward_backward(*batch(), loss_scale=1.0, sync=True)
        torch.testing.assert_close(loss, reference_step(reference))
        ref = dict(reference.named_parameters(remove_duplicate=False))
        for name, p in engine.owned.named_parameters():
            torch.testing.assert_close(p.grad, ref[name.removeprefix("blocks.")].grad, msg=name)
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf"))
        torch.testing.assert_close(engine.grad_norm(), want)
    finally:
        engine.close()


def test_a_weight_tied_within_one_stage_stays_one_parameter(world1):
    blocks = make_blocks()
    blocks[1][0].weight = blocks[0][0].weight
    cfg = ParallelConfig(dp=1, pp=1, local_stages=2, microbatches=2, balance="2,2")
    engine = ProcessModel(blocks, nn.functional.mse_loss, cfg, world_of(cfg, CPU))
    try:
        assert blocks[1][0].weight is blocks[0][0].weight and engine.ties.ties == []
        assert engine.owned.aliases == {"blocks.1.0.weight": "blocks.0.0.weight"}
    finally:
        engine.close()


def test_engine_evaluate_runs_without_gradients(engine_and_reference):
    engine, reference = engine_and_reference
    grad_mode = []
    engine.owned.blocks["0"].register_forward_hook(lambda *_: grad_mode.append(torch.is_grad_enabled()))
    loss = engine.evaluate(*batch())
    with torch.no_grad():
        want = nn.functional.mse_loss(reference(batch()[0]), batch()[1])
    torch.testing.assert_close(loss, want)
    assert grad_mode and not any(grad_mode)
    assert not loss.requires_grad
    assert all(p.grad is None for p in engine.owned.parameters())


# One 2-process launch: every dp × pp shape of a world of 2, the blocks each rank owns, the error.

SHAPES = [(2, 1), (1, 2)]


def layouts_worker() -> dict:
    """Per shape: this rank's place, its groups' ranks and its owned blocks' names; and the error."""
    info = groups.init(threads=1)
    out: dict = {}
    for dp, pp in SHAPES:
        cfg = ParallelConfig(dp=dp, pp=pp, microbatches=2)
        world = world_of(cfg, info.device)
        engine = ProcessModel(make_blocks(), nn.functional.mse_loss, cfg, world)
        names = sorted({n.split(".")[1] for n, _ in engine.owned.named_parameters()}, key=int)
        out[f"{dp}x{pp}"] = dict(place=(world.coords.dp, world.coords.pp),
                                 dp_group=dist.get_process_group_ranks(world.group("dp")),
                                 pp_group=dist.get_process_group_ranks(world.group("pp")),
                                 blocks=[int(i) for i in names])
        engine.close()
    try:
        world_of(ParallelConfig(dp=2, pp=2), info.device)
    except BrigadeError as exc:
        out["error"] = str(exc)
    out["replan"] = _replan_case(info.device)
    groups.destroy()
    return out


def _replan_case(device) -> dict:
    """pp 2 × V 2 under auto, with dropout: a traced step, `replan` on its times, a plan of skewed
    costs; the same batch's loss and gradients after each, from the same generator state (bit for
    bit: each stage keeps micro-batch order, each forward draws from its own stream)."""
    cfg = ParallelConfig(dp=1, pp=2, microbatches=4, schedule="auto", virtual=2)
    blocks = [nn.Sequential(b, nn.Dropout(0.5)) for b in make_blocks()]
    torch.set_num_threads(1 + dist.get_rank())  # rank 1's stages want 2 cores: the two disagree
    engine = ProcessModel(blocks, nn.functional.mse_loss, cfg, world_of(cfg, device))
    torch.set_num_threads(1)

    def step(trace: bool = False) -> list[torch.Tensor]:
        torch.manual_seed(5)  # the step's streams: from the generator, whatever the plan
        loss = engine.forward_backward(*batch(8), loss_scale=1.0, sync=True, trace=trace)
        got = [loss.detach().clone(), *(p.grad.clone() for p in engine.owned.parameters())]
        engine.owned.zero_grad(set_to_none=True)
        return got

    first, plans = step(trace=True), [list(engine.pipe.plan)]
    costs = engine.replan()
    plans.append(list(engine.pipe.plan))
    measured = step()
    engine.pipe.replan(Costs((1.0,) * 4, (1.0,) * 4, (1.0, 1.0, 1.0, 9.0)))  # stage 3's W 9x
    plans.append(list(engine.pipe.plan))
    skewed = step()
    engine.close()
    return {"costs": [costs.forward, costs.input_grad, costs.weight, costs.whole(0)], "cores": costs.cores,
            "same": [all(torch.equal(a, b) for a, b in zip(first, other)) for other in (measured, skewed)],
            "plans": [[str(a) for a in plan] for plan in plans]}


@pytest.fixture(scope="module")
def launched() -> dict:
    """One 2-process launch for every case below (`layouts_worker`)."""
    return agent.launch(layouts_worker, 2)


@pytest.mark.xdist_group("layout-2proc")
@pytest.mark.timeout(300)
def test_layouts_over_two_processes(launched):
    results = launched
    assert sorted(results) == [0, 1]
    for dp, pp in SHAPES:
        owners: dict[int, list[int]] = {}
        for rank, got in results.items():
            case = got[f"{dp}x{pp}"]
            dp_rank, pp_rank = rank // pp, rank % pp  # the documented rank = dp_rank · pp + pp_rank
            assert tuple(case["place"]) == (dp_rank, pp_rank), (dp, pp, rank)
            assert case["pp_group"] == [dp_rank * pp + s for s in range(pp)]  # this pipeline's row
            assert case["dp_group"] == [r * pp + pp_rank for r in range(dp)]  # this stage's column
            owners.setdefault(pp_rank, case["blocks"])
            assert case["blocks"] == owners[pp_rank]  # replicas hold the same blocks
        # Stages own consecutive, disjoint runs of the global indices, covering the model.
        assert [i for s in range(pp) for i in owners[s]] == list(range(N_BLOCKS))
    for got in results.values():
        assert got["error"].startswith("--dp 2 × --pp 2 = 4 but the world size is 2")


@pytest.mark.xdist_group("layout-2proc")
@pytest.mark.timeout(300)
def test_auto_plans_again_on_measured_costs_and_the_numbers_stay_the_same(launched):
    zero, one = (launched[r]["replan"] for r in (0, 1))
    assert zero["costs"] == one["costs"]  # agreed by every process
    forward, input_grad, weight, whole0 = zero["costs"]
    assert min(forward) > 0 and min(input_grad[1:]) > 0 and min(weight[1:]) > 0 and whole0 > 0
    assert zero["same"] == one["same"] == [True, True]  # the same bits under every plan
    assert zero["plans"][2] != zero["plans"][0]  # the skewed costs reordered rank 0's stages


@pytest.mark.xdist_group("layout-2proc")
@pytest.mark.timeout(300)
def test_auto_plans_on_the_cores_the_host_gives_agreed_by_every_process(launched):
    from brigade.host.cores import shared_cores

    # two processes on this host, of 1 and 2 threads: the tighter share, where either is short
    shares = [shared_cores(2, 2, threads) for threads in (1, 2)]
    want = min((s for s in shares if s), default=0.0)  # 1.0 on 2 cores (rank 1 gets half its 2)
    assert launched[0]["replan"]["cores"] == launched[1]["replan"]["cores"] == want
