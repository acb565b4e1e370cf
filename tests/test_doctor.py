"""brigade doctor: each check's PASS and FAIL, alone and through the CLI on this machine."""

import socket
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist

from brigade import doctor
from brigade.doctor import Check, Setup
from brigade.host import net
from brigade.host.net import free_port
from brigade.launcher import agent, groups
from tests.e2e.helpers import brigade


def test_a_fail_line_says_how_to_fix_it():
    assert Check("port", True, "29500 is free").line() == "PASS  port            29500 is free"
    assert Check("port", False, "in use", "choose another").line().splitlines() == [
        "FAIL  port            in use", "      fix: choose another"]


def test_port_in_use_fails():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        check = doctor.check_port(Setup(port=port))
    assert not check.ok and f"{port} is already in use" in check.detail and "another port" in check.fix


def test_an_endpoint_that_does_not_answer_fails(monkeypatch):
    monkeypatch.setattr(net, "REACH_WAIT_S", 1.0)  # the wait is not the point; 15 s by default
    port = free_port()
    check = doctor.check_endpoint(Setup(nnodes=2, node_rank=1, rdzv_endpoint=f"127.0.0.1:{port}"))
    assert not check.ok and "nothing answers" in check.detail and "start node 0 first" in check.fix


def test_node_0_must_own_the_endpoint_address():
    check = doctor.check_endpoint(Setup(nnodes=2, node_rank=0, rdzv_endpoint="192.0.2.1:29500"))
    assert not check.ok and "not an address of this node" in check.detail
    ok = doctor.check_endpoint(Setup(nnodes=2, node_rank=0, rdzv_endpoint="127.0.0.1:29500"))
    assert ok.ok


def test_a_local_address_of_another_machine_fails():
    check = doctor.check_address(Setup(nnodes=2, rdzv_endpoint="127.0.0.1:29500", local_addr="192.0.2.7"))
    assert not check.ok and check.detail == "--local-addr 192.0.2.7 is not an address of this machine"
    assert check.fix.startswith("give one of its own IPv4 addresses")


def test_the_advertised_address_and_its_interface():
    check = doctor.check_address(Setup(nnodes=2, rdzv_endpoint="127.0.0.1:29500"))
    assert check.ok and check.detail.startswith("advertises 127.0.0.1 on lo")


def test_folder_views_that_differ_mean_not_shared():
    views = [{"node": 0, "error": "", "seen": ["node0"], "free": 2**30},
             {"node": 1, "error": "", "seen": ["node1"], "free": 2**30}]
    check = doctor._folder_check("/runs", views, 2)
    assert not check.ok and "not the same folder everywhere" in check.detail
    views = [{**v, "seen": ["node0", "node1"]} for v in views]
    assert doctor._folder_check("/runs", views, 2).ok


def test_clock_skew_above_a_second_fails():
    assert not doctor.skew_check((2.5, 0.001, 3)).ok
    assert "rank 3's clock is 2.50 s off" in doctor.skew_check((2.5, 0.001, 3)).detail
    assert doctor.skew_check((0.004, 0.001, 3)).ok and doctor.skew_check(None).ok


def test_doctor_on_this_machine(tmp_path):
    result = brigade("doctor", "--out", tmp_path / "runs", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    names = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("PASS")]
    assert names == ["backend", "port", "endpoint", "all-reduce", "point-to-point", "snapshot", "clock"]
    assert "latency" in result.stdout and "GB/s" in result.stdout
    assert not (tmp_path / "runs").exists()


@pytest.mark.timeout(200)
def test_doctor_with_one_process_checks_what_it_can_and_skips_point_to_point(tmp_path):
    result = brigade("doctor", "--nproc", "1", "--out", tmp_path / "runs", timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr  # was: ZeroDivisionError in rank 0
    lines = result.stdout.splitlines()
    names = [line.split()[1] for line in lines if line.startswith("PASS")]
    assert names == ["backend", "port", "endpoint", "all-reduce", "snapshot", "clock"]
    assert any(line.startswith("PASS  all-reduce      correct on 1 rank") for line in lines)
    assert "SKIP  point-to-point  skipped: 1 process, no peer" in lines
    assert "FAIL" not in result.stdout


def test_a_skipped_check_is_not_a_failure():
    skip = Check("point-to-point", True, "skipped: 1 process, no peer", skipped=True)
    assert skip.line() == "SKIP  point-to-point  skipped: 1 process, no peer"
    assert Check(**asdict(skip)) == skip  # crosses from the workers as a dict


def test_doctor_fails_an_unwritable_snapshot_folder(tmp_path):
    (tmp_path / "a-file").write_text("x")
    result = brigade("doctor", "--out", tmp_path / "a-file" / "runs", timeout=120)
    assert result.returncode == 1
    assert "FAIL  snapshot folder node 0 cannot write in" in result.stdout
    assert "fix: choose an --out that every node can write" in result.stdout
    assert (tmp_path / "a-file").read_text() == "x"


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
    checks = [doctor._allreduce(info.device, info.world_size, info.rank, 1024, 12345),
              doctor._p2p(info.device, info.world_size, info.rank, 1024, 12345)]
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
    a, b = doctor.sender_data(0, 7, 64, cpu), doctor.sender_data(1, 7, 64, cpu)
    assert torch.equal(a, doctor.sender_data(0, 7, 64, cpu)) and not torch.equal(a, b)
    assert not torch.equal(a, doctor.sender_data(0, 8, 64, cpu))  # another run, other data
