"""Expert parallel (brigade/parallel/experts.py): the experts split over an expert group, tokens sent
to them and back by all-to-all, equal to the layer whole on one process; the plan's agreement.

One 2-process gloo world (dp 2, ep 2) answers the multi-process cases; `brigade check --ep`
(tests/check/test_run.py) and the trainer's equivalence (tests/train/test_trainer.py) prove
the whole under every schedule."""

from __future__ import annotations

import copy

import pytest
import torch

from brigade.errors import BrigadeError, RunError
from brigade.launcher import agent, groups
from brigade.models.moe import MoE, MoEConfig
from brigade.parallel import experts
from brigade.world.degrees import Degrees
from brigade.world.mesh import World

C = 8


def _layer(**kw) -> MoE:
    torch.manual_seed(0)
    return MoE(C, MoEConfig(**{"experts": 4, "top_k": 2, "hidden": 8, "shared_hidden": 4, **kw}))


def test_rows_arrived_source_by_source_are_regrouped_expert_by_expert():
    # from source 0: 2 rows for expert 0, 1 for expert 1; from source 1: 0 and 3
    table = torch.tensor([[2, 1], [0, 3]])
    assert experts._expert_major(table).tolist() == [0, 1, 2, 3, 4, 5]  # e0: s0's 2; e1: s0's 1, s1's 3
    table = torch.tensor([[1, 2], [3, 1]])  # rows 0 | 1 2 | 3 4 5 | 6
    assert experts._expert_major(table).tolist() == [0, 3, 4, 5, 1, 2, 6]


def test_an_ep_that_does_not_divide_the_experts_is_refused_in_one_line():
    with pytest.raises(BrigadeError, match=r"--ep 3 does not divide the 4 experts of block 0: give --ep "
                                           r"a divisor of 4"):
        experts.check_divides([_layer()], 3)
    experts.check_divides([_layer(), torch.nn.Linear(2, 2)], 2)


def worker() -> dict:
    """Rank r's half of the batch through the layer split over ep 2, against the layer whole."""
    info = groups.init(threads=1)
    world = World(Degrees(dp=2, ep=2), info.device)
    whole = _layer()
    split = copy.deepcopy(whole)
    experts.split_experts([split], world)
    x = torch.randn(4, 6, C, generator=torch.Generator().manual_seed(1), requires_grad=True)
    mine = x.detach()[2 * world.rank:2 * world.rank + 2].requires_grad_()
    split(mine).square().sum().backward()
    whole(x).square().sum().backward()
    out = {"placements": [str(p.placements) for p in split.experts.parameters()],
           "local": [tuple(p.to_local().shape) for p in split.experts.parameters()],
           "expert": [experts.is_expert(p) for p in split.parameters()],
           "x_grad": (mine.grad - x.grad[2 * world.rank:2 * world.rank + 2]).abs().max().item()}
    out["w_grad"] = max((p.grad.to_local() - q.grad[2 * world.rank:2 * world.rank + 2]).abs().max().item()
                        for p, q in zip(split.experts.parameters(), whole.experts.parameters()))
    experts.same_plan(["0F0", "0B0"], world)  # the same on both: passes
    try:
        experts.same_plan(["0F0", "0B0"] if world.rank == 0 else ["0B0", "0F0"], world)
    except RunError as exc:
        out["differs"] = str(exc)
    out["pipeline"] = _pipelines_that_differ(world)
    groups.destroy()
    return out


def _pipelines_that_differ(world) -> str:
    """The GPT's experts split over both replicas, one replica's pipeline GPipe (F0 F1 B0 B1) and
    the other's 1F1B (F0 B0 F1 B1): their second all-to-alls would pair an F's rows with a B's
    gradients. The pipeline is refused where it is built, before any step."""
    from brigade.models.gpt import GPTConfig, gpt, gpt_loss
    from brigade.parallel.assemble import Cut, assemble

    torch.manual_seed(0)
    blocks = gpt(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8, experts=4))
    built = assemble(blocks, Cut((len(blocks),), (0,)), world)
    try:
        built.pipeline("gpipe" if world.rank == 0 else "1f1b", 2, gpt_loss)
    except RunError as exc:
        return str(exc)
    return "built"


@pytest.fixture(scope="module")
def launched() -> dict:
    return agent.launch(worker, 2)


@pytest.mark.timeout(120)
def test_the_experts_split_over_two_processes_compute_what_the_whole_layer_does(launched):
    """Each process's tokens, its half of the batch: the input's gradient is the whole layer's
    on that half; each process's experts' gradient is the whole layer's over both halves (every
    token that reached them, from either process)."""
    for rank, got in launched.items():
        assert got["placements"] == ["(Shard(dim=0),)"] * 2
        assert got["local"] == [(2, 16, C), (2, C, 8)]  # 2 of the 4 experts: gate_up_proj, down_proj
        assert got["expert"].count(True) == 2  # the router and the shared expert are dense
        assert got["x_grad"] < 1e-5 and got["w_grad"] < 1e-5, (rank, got)


@pytest.mark.timeout(120)
def test_replicas_whose_plans_differ_are_refused_before_an_all_to_all_could_hang(launched):
    for got in launched.values():
        for said in (got["differs"], got["pipeline"]):
            assert "pipeline rank 0's plan differs between data-parallel replicas" in said
            assert "all-to-alls would pair in different orders and hang" in said
