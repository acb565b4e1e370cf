"""brigade doctor's group checks (`brigade.doctor_group`): each check's PASS and FAIL, the data a
rank sends its own, and a group that loses data failed by the all-reduce or point-to-point check."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist

from brigade import doctor_group
from brigade.launcher import agent, groups


def test_folder_views_that_differ_mean_not_shared():
    views = [{"node": 0, "error": "", "seen": ["node0"], "free": 2**30},
             {"node": 1, "error": "", "seen": ["node1"], "free": 2**30}]
    check = doctor_group._folder_check("/runs", views, 2)
    assert not check.ok and "not the same folder everywhere" in check.detail
    views = [{**v, "seen": ["node0", "node1"]} for v in views]
    assert doctor_group._folder_check("/runs", views, 2).ok


def test_clock_skew_above_a_second_fails():
    assert not doctor_group.skew_check((2.5, 0.001, 3)).ok
    assert "rank 3's clock is 2.50 s off" in doctor_group.skew_check((2.5, 0.001, 3)).detail
    assert doctor_group.skew_check((0.004, 0.001, 3)).ok and doctor_group.skew_check(None).ok


def _broken_delivery_worker(fault: str) -> list[dict]:
    """One rank of a 2-rank group: the doctor's all-reduce and point-to-point checks while
    torch.distributed loses data as `fault` says (the calls still pair up, so nothing hangs)."""
    info = groups.init("gloo", threads=1, timeout_s=60)
    send, recv = dist.send, dist.recv
    if fault == "recv-keeps-nothing":  # the data crosses but never lands in the caller's buffer
        dist.recv = lambda t, src=None, *a, **k: recv(torch.empty_like(t), src, *a, **k)
    elif fault == "send-zeros":
        dist.send = lambda t, dst=None, *a, **k: send(torch.zeros_like(t), dst, *a, **k)
    elif fault == "all-reduce-does-nothing":
        dist.all_reduce = lambda *a, **k: None
    checks = [doctor_group._allreduce(info.device, info.world_size, info.rank, 1024, 12345),
              doctor_group._p2p(info.device, info.world_size, info.rank, 1024, 12345)]
    groups.destroy()
    return [asdict(c) for c in checks if c is not None]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault,failing", [
    ("none", []),
    ("recv-keeps-nothing", ["point-to-point"]),  # passed before the doctor sent data only the sender knows
    ("send-zeros", ["point-to-point"]),
    ("all-reduce-does-nothing", ["all-reduce"]),
])
def test_the_doctor_fails_when_data_is_not_delivered(fault, failing):
    checks = agent.launch(_broken_delivery_worker, 2, fault)[0]
    assert [c["name"] for c in checks] == ["all-reduce", "point-to-point"]
    assert [c["name"] for c in checks if not c["ok"]] == failing, checks
    for c in checks:
        if not c["ok"]:
            assert "rank" in c["detail"] and c["fix"], c
    if "point-to-point" in failing:
        assert checks[1]["detail"] in ("what rank 1 sent arrived altered at rank 0",
                                       "what rank 0 sent arrived altered at rank 1")


def test_each_rank_sends_its_own_data():
    cpu = torch.device("cpu")
    a, b = doctor_group.sender_data(0, 7, 64, cpu), doctor_group.sender_data(1, 7, 64, cpu)
    assert torch.equal(a, doctor_group.sender_data(0, 7, 64, cpu)) and not torch.equal(a, b)
    assert not torch.equal(a, doctor_group.sender_data(0, 8, 64, cpu))  # another run, other data
