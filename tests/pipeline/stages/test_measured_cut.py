"""`measured_cut.auto_balance`: auto's cut where a run starts, from the blocks' measured times;
the search's cut on those times, the parameter cut where the blocks cannot run, rank 0's on
every process, and rank 0's error on every process."""

import pytest
import torch
from torch import nn

from brigade.errors import BrigadeError
from brigade.launcher import agent, groups
from brigade.pipeline.plans.cuts import choose_cut
from brigade.pipeline.stages import measured_cut
from brigade.pipeline.stages.partition import param_costs, solve, time_costs, time_parts

RAMP = [(0.5 + 0.1 * k, 1.0 + 0.2 * k) for k in range(12)]  # (forward, backward) s: dearer and dearer


def _blocks(n=12, width=8):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n)]


def test_a_blocks_forward_and_backward_are_timed_apart_and_add_up_to_its_time():
    parts = time_parts(_blocks(3), torch.randn(4, 8), repeats=3)
    assert len(parts) == 3 and all(f > 0 and b > 0 for f, b in parts)
    assert len(time_costs(_blocks(3), torch.randn(4, 8), repeats=1)) == 3


def test_auto_takes_the_cut_the_search_keeps_on_the_times_with_halves_for_i_and_w(monkeypatch):
    """On a ramp the solver balances each stage ([5, 3, 2, 2] at p 2, V 2); auto runs the cut
    `choose_cut` keeps from the same times, which balances each rank's pair."""
    monkeypatch.setattr(measured_cut, "time_parts", lambda blocks, sample, repeats: RAMP)
    got = measured_cut.auto_balance(_blocks(), torch.randn(4, 8), ranks=2, virtual=2, microbatches=8)
    costs = [(f, b, b / 2, b / 2) for f, b in RAMP]
    solver = solve([f + b for f, b in RAMP], 4)
    assert got == list(choose_cut(costs, 2, 8, (2,), given=[solver]).balance) != solver == [5, 3, 2, 2]


def test_real_blocks_get_a_cut_of_every_block_into_the_stages_timed_on_copies_on_the_device():
    blocks = _blocks(6)
    before = [p.clone() for b in blocks for p in b.parameters()]
    sample = {"x": torch.randn(2, 8)}  # a structure: its tensors go to the device too
    blocks[0] = _Keyed(blocks[0])
    got = measured_cut.auto_balance(blocks, sample, ranks=2, virtual=1, microbatches=4,
                                    device=torch.device("cpu"))
    assert len(got) == 2 and sum(got) == 6 and min(got) >= 1
    after = [p for b in blocks for p in b.parameters()]
    assert all(torch.equal(a, b) and a.grad is None for a, b in zip(after, before))  # copies were timed


class _Keyed(nn.Module):
    """A first block that takes the sample's dict."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x["x"])


def test_blocks_without_memory_get_the_parameter_cut():
    with torch.device("meta"):
        blocks = _blocks(6)
    got = measured_cut.auto_balance(blocks, None, ranks=3, virtual=1, microbatches=4)
    assert got == solve(param_costs(blocks), 3)


@pytest.mark.parametrize("kwargs, message", [
    (dict(ranks=4, virtual=2), r"^stages=8 but the model has only 6 blocks"),
    (dict(ranks=2, virtual=2, limit=1), r"^auto: a memory limit of 1 micro-batch activations per rank"),
])
def test_what_auto_cannot_cut_is_refused_in_one_line(kwargs, message):
    with pytest.raises(BrigadeError, match=message):
        measured_cut.auto_balance(_blocks(6), torch.randn(2, 8), microbatches=4, **kwargs)


def _worker(rank_zero_error: bool):
    """Each rank times different blocks (rank 1's ramp runs the other way); all keep rank 0's cut."""
    groups.init(threads=1)
    rank = torch.distributed.get_rank()
    ramp = RAMP if rank == 0 else RAMP[::-1]
    measured_cut.time_parts = lambda blocks, sample, repeats: ramp  # this process only
    try:
        got = measured_cut.auto_balance(_blocks(), torch.randn(4, 8), ranks=2, virtual=2, microbatches=8,
                                        limit=1 if rank_zero_error else 0)
    except BrigadeError as exc:
        got = f"error: {exc}"
    groups.destroy()
    return got


@pytest.mark.timeout(180)
@pytest.mark.xdist_group("measured_cut")
def test_every_process_builds_rank_zeros_cut_and_hears_its_error():
    cuts = agent.launch(_worker, 2, False)
    assert cuts[0] == cuts[1] and sum(cuts[0]) == 12
    errors = agent.launch(_worker, 2, True)
    assert errors[0] == errors[1] and errors[0].startswith("error: auto: a memory limit of 1")
