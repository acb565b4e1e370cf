import itertools
import random

import pytest
import torch
from torch import nn

from brigade.errors import BrigadeError
from brigade.pipeline.stages.partition import (
    check_balance,
    check_chain,
    choose_balance,
    param_costs,
    parse_balance,
    solve,
    split,
    time_costs,
    time_parts,
)


def brute_force(costs, p):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_solver_is_optimal(seed):
    rng = random.Random(seed)
    costs = [rng.randint(1, 20) for _ in range(rng.randint(2, 9))]
    p = rng.randint(1, len(costs))
    balance = solve(costs, p)
    assert len(balance) == p and sum(balance) == len(costs) and min(balance) >= 1
    bounds = [0, *itertools.accumulate(balance)]
    worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert worst == brute_force(costs, p)


def test_solver_examples():
    assert solve([1, 1, 1, 1], 2) == [2, 2]
    assert solve([10, 1, 1, 1, 1], 2) == [1, 4]
    assert solve([5], 1) == [1]


def test_parse_balance():
    assert parse_balance("3,5") == [3, 5]
    with pytest.raises(BrigadeError, match="comma-separated"):
        parse_balance("3,x")


@pytest.mark.parametrize("balance,n,p,message", [
    ([3, 4], 8, 2, "sums to 7 but the model has 8 blocks"),
    ([8, 0], 8, 2, "stage 1 would hold 0 blocks"),
    ([4, 4], 8, 3, "has 2 stages but 3 were asked for"),
])
def test_check_balance_errors(balance, n, p, message):
    with pytest.raises(BrigadeError, match=message):
        check_balance(balance, n, p)


def test_more_stages_than_blocks():
    with pytest.raises(BrigadeError, match="stages=4 but the model has only 3 blocks"):
        choose_balance([nn.ReLU()] * 3, 4)
    with pytest.raises(BrigadeError, match="stages=0"):
        choose_balance([nn.ReLU()] * 3, 0)


def test_balance_by_params_and_by_time():
    blocks = [nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 64), nn.ReLU()]
    assert param_costs(blocks)[1] == 1.0
    assert choose_balance(blocks, 2, by="params") == [2, 3]
    costs = time_costs(blocks, torch.randn(8, 64), repeats=1)
    assert len(costs) == 5 and all(c > 0 for c in costs)
    bal = choose_balance(blocks, 2, by="time", sample=torch.randn(8, 64))
    assert sum(bal) == 5 and len(bal) == 2
    with pytest.raises(BrigadeError, match="unknown balance method"):
        choose_balance(blocks, 2, by="magic")


def test_time_costs_are_the_median_of_the_timed_runs(monkeypatch):
    """Per block: one untimed warm-up, then the median of `repeats` timings (1, 10 and 2 s here:
    2, where the mean would say 4.33 and the max 10); `time_parts` takes the forward's and the
    backward's medians apart (0.5, 3, 1 and 0.5, 7, 1 s: 1 and 1)."""
    from brigade.pipeline.stages import partition

    # per block and run (the warm-up first): the clock at the start, after the forward, at the end
    runs = [0.0, 50.0, 100.0, 100.0, 100.5, 101.0, 200.0, 203.0, 210.0, 300.0, 301.0, 302.0]
    clock = iter(runs * 4)
    monkeypatch.setattr(partition.time, "perf_counter", lambda: next(clock))
    assert time_costs([nn.Linear(4, 4), nn.Linear(4, 4)], torch.randn(2, 4), repeats=3) == [2.0, 2.0]
    assert time_parts([nn.Linear(4, 4), nn.Linear(4, 4)], torch.randn(2, 4), repeats=3) == [(1.0, 1.0)] * 2


def test_split_shares_modules_in_order():
    blocks = [nn.Linear(2, 2) for _ in range(5)]
    stages = split(blocks, [2, 3])
    assert [len(s) for s in stages] == [2, 3]
    assert stages[1][0] is blocks[2]


def test_check_chain_names_both_blocks_and_shapes():
    blocks = [nn.Linear(10, 7), nn.ReLU(), nn.Linear(10, 5)]
    with pytest.raises(BrigadeError, match=r"block 1 \(ReLU\) outputs shape \(2, 7\), which block 2 "
                                           r"\(Linear\) cannot take"):
        check_chain(blocks, torch.randn(2, 10))
    with pytest.raises(BrigadeError, match=r"block 0 \(Linear\) cannot take the input of shape \(2, 3\)"):
        check_chain(blocks, torch.randn(2, 3))
    check_chain(blocks[:2], torch.randn(2, 10))
