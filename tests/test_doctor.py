"""brigade doctor: each check's PASS and FAIL, alone and through the CLI on this machine."""

import socket
from dataclasses import asdict

import pytest

from brigade import doctor
from brigade.doctor import Check, Setup
from brigade.host import net
from brigade.host.net import free_port
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
