"""bench/peers.py: torch's schedules (one and several stages per rank) on the same stages as brigade."""

import copy

import pytest
import torch
from torch import nn
from torch.distributed import pipelining

from brigade.bench.peers import TORCH_SCHEDULES, TorchPipelining, local_stages, unsupported
from brigade.launcher import agent, groups

BATCH, M = 8, 4


def mlp() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)]


def loss_fn(out, y):
    return ((out - y) ** 2).mean()


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 6, generator=g)


def test_the_table_holds_every_schedule_the_installed_torch_offers():
    offered = {n for n in dir(pipelining) if n.startswith("Schedule")}
    assert {s.cls for s in TORCH_SCHEDULES.values()} == offered
    assert all(s.twin == name for name, s in TORCH_SCHEDULES.items())  # none torch-only
    assert TORCH_SCHEDULES["zb"].cls == "ScheduleInterleavedZeroBubble" and TORCH_SCHEDULES["zb"].note


def test_placements_loop_and_v():
    assert [local_stages("v", r, 3, 2) for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    assert local_stages("v", 0, 2, 2) == [0, 3] and local_stages("loop", 1, 2, 2) == [1, 3]
    assert local_stages("loop", 1, 2, 1) == [1]


def test_unsupported_names_each_rule():
    assert unsupported("1f1b", 2, 1, 4, 8) is None
    assert "no peer" in unsupported("nosuch", 2, 1, 4, 8)
    assert "V = 1" in unsupported("zbv", 2, 1, 4, 8)
    assert "equal micro-batches" in unsupported("gpipe", 2, 1, 3, 8)
    assert "multiple of max(1, m // p) = 2" in unsupported("interleaved", 2, 2, 5, 10)
    assert "DualPipeV needs m >= 4" in unsupported("dualpipev", 2, 2, 2, 8)
    assert unsupported("dualpipev", 2, 2, 4, 8) is None


def peers_worker() -> dict:
    info = groups.init("gloo", threads=1)
    x, y = batch()
    out = {}
    for name, spec in TORCH_SCHEDULES.items():
        for v in spec.virtual:
            blocks = mlp()
            n = 2 * v
            per = len(blocks) // n
            stages = [nn.Sequential(*blocks[k * per:(k + 1) * per]) for k in range(n)]
            mine = {s: stages[s] for s in local_stages(spec.placement, info.rank, 2, v)}
            peer = TorchPipelining(mine, n, name, M, loss_fn, info.device)
            peer.step(x, y)
            out[(name, v)] = {s: [p.grad.clone() for p in m.parameters()] for s, m in mine.items()}
    groups.destroy()
    return out


@pytest.mark.timeout(240)
def test_every_torch_schedule_steps_and_matches_one_device():
    ref = nn.Sequential(*copy.deepcopy(mlp()))
    x, y = batch()
    loss_fn(ref(x), y).backward()
    want = [[p.grad for p in b.parameters()] for b in ref]
    results = agent.launch(peers_worker, 2)
    assert set(results[0]) == {(n, v) for n, s in TORCH_SCHEDULES.items() for v in s.virtual}
    for key in results[0]:
        held = {**results[0][key], **results[1][key]}
        per = 4 // len(held)
        assert sorted(held) == list(range(len(held))), key
        for s, grads in held.items():
            expect = [g for b in range(s * per, (s + 1) * per) for g in want[b]]
            for got, exp in zip(grads, expect, strict=True):
                torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6, msg=str(key))
