"""Hang forensics: the verdict from every rank's last action, and the watchdog on a real store."""

import time

import torch.distributed as dist

from brigade import forensics


def row(rank, action="RECV_F mb0 from stage 0 (rank 0)", waiting=True, on=None, age=31.0):
    return {"rank": rank, "node": "host", "place": f"pp{rank}", "action": action, "age": age,
            "waiting": waiting, "on": on}


def test_the_rank_outside_communication_is_the_culprit():
    rows = [row(0, on=1), row(1, "step 5 begins", waiting=False), row(2, "allreduce bucket 4")]
    culprits, why = forensics.verdict(rows, 3)
    assert culprits == [1]
    assert why.startswith("rank 1 made no progress") and "ranks 0, 2 wait for it" in why


def test_a_rank_that_does_not_answer_is_named():
    culprits, why = forensics.verdict([row(0), row(1)], 3)
    assert culprits == [2] and "rank 2 did not answer" in why


def test_a_cycle_of_receives_is_a_deadlock():
    rows = [row(0, on=1), row(1, on=2), row(2, on=0)]
    culprits, why = forensics.verdict(rows, 3)
    assert sorted(culprits) == [0, 1, 2] and why.startswith("deadlock: ranks 0 → 1 → 2 → 0")


def test_everyone_waiting_without_a_cycle_blames_communication():
    culprits, why = forensics.verdict([row(0, "allreduce bucket 1"), row(1, "allreduce bucket 2")], 2)
    assert culprits == [] and "every rank waits on communication" in why


def test_table_has_one_line_per_rank_and_marks_the_stuck_one():
    table, culprits = forensics.render([row(0, on=1), row(1, "step 5 begins", waiting=False)], 2, 30)
    lines = table.splitlines()
    assert lines[0] == "brigade: hang — no progress for 31 s (--hang-timeout 30)"
    assert lines[2].split()[0] == "0" and lines[2].endswith("waiting")
    assert lines[3].split()[0] == "1" and lines[3].endswith("<- stuck") and "step 5 begins" in lines[3]
    assert lines[-1].startswith("verdict: rank 1")


def test_watchdog_reports_and_exits_when_nothing_moves(tmp_path, capsys):
    exits = []
    forensics.doing("step 3 begins")
    dog = forensics.Watchdog(dist.HashStore(), rank=0, world=1, timeout_s=0.3, warmup_s=0.3,
                             out=tmp_path, place="dp0 pp0", poll_s=0.05, exit=exits.append)
    dog.start()
    deadline = time.monotonic() + 15
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exits == [forensics.EXIT_CODE]
    printed = capsys.readouterr().out
    assert "step 3 begins" in printed and "<- stuck" in printed
    assert "test_forensics.py" in printed  # the main thread's stack, where it waits
    report = (tmp_path / "logs" / "hang-report.txt").read_text()
    assert "=== rank 0" in report and "verdict: rank 0" in report


def test_watchdog_stays_quiet_while_actions_keep_coming(tmp_path):
    exits = []
    dog = forensics.Watchdog(dist.HashStore(), rank=0, world=1, timeout_s=0.5, warmup_s=0.5,
                             out=tmp_path, poll_s=0.05, exit=exits.append).start()
    dog.arm()
    for i in range(30):
        forensics.doing(f"F mb{i}")
        time.sleep(0.05)
    dog.stop()
    assert exits == [] and not (tmp_path / "logs").exists()


def test_a_raised_flag_makes_every_rank_report():
    store, exits = dist.HashStore(), []
    forensics.doing("RECV_F mb0 from stage 0 (rank 0)", waiting=True, on=0)
    dog = forensics.Watchdog(store, rank=1, world=2, timeout_s=60, warmup_s=60, poll_s=0.05,
                             exit=exits.append)
    dog.report_wait_s = 0.5  # rank 0 never answers here
    store.add("hang", 1)  # another rank saw the hang first
    dog.start()
    deadline = time.monotonic() + 30
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exits == [forensics.EXIT_CODE]
    assert "RECV_F mb0" in store.get("report/1").decode()


def test_a_paused_watchdog_does_not_judge_and_resumes_afresh(tmp_path):
    exits = []
    dog = forensics.Watchdog(dist.HashStore(), rank=0, world=1, timeout_s=0.4, warmup_s=0.4,
                             out=tmp_path, poll_s=0.05, exit=exits.append)
    dog.pause()
    dog.start()
    time.sleep(1.0)  # idle, but outside fit(): not a hang
    assert exits == []
    dog.resume()
    time.sleep(0.2)
    assert exits == []  # the pause does not count towards the timeout
    deadline = time.monotonic() + 15
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exits == [forensics.EXIT_CODE]


def test_ddp_gradient_buckets_are_recorded(monkeypatch):
    import torch

    from brigade.launcher import groups
    from brigade.parallel.replicate import data_parallel

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)  # init() sets them; they must not outlive this test
    def backward_through_ddp() -> tuple:
        model = data_parallel(torch.nn.Linear(4, 4), None, None)
        model(torch.ones(2, 4)).sum().backward()
        return forensics.current()["MainThread"]  # the DDP model is freed here, before its group

    groups.init("gloo")  # a group of one, in this process
    try:
        what, _, waiting, _ = backward_through_ddp()
        assert what == "allreduce bucket 0" and waiting
    finally:
        groups.destroy()
