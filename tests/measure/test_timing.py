"""`measure.timing.interleaved_rounds`: every configuration timed once per round, in an order the
ranks agree on."""

import pytest


def rounds_worker(keys_of_rank1: list[str] | None) -> dict:
    import torch.distributed as dist

    from brigade.launcher import groups
    from brigade.measure.timing import interleaved_rounds

    info = groups.init("gloo", threads=1)
    calls: list[str] = []
    keys = ["a", "b", "c", "d"] if keys_of_rank1 is None or info.rank == 0 else keys_of_rank1
    steps = {k: (lambda k=k: calls.append(k)) for k in keys}
    try:
        times = interleaved_rounds(steps, rounds=3, warmup=1, device=info.device, seed=5)
    except Exception as exc:  # noqa: BLE001 -- the test reads the message
        dist.barrier()
        groups.destroy()
        return {"error": str(exc)}
    groups.destroy()
    return {"calls": calls, "times": times}


@pytest.mark.timeout(120)
def test_interleaved_rounds_time_each_configuration_once_per_round_in_an_agreed_order():
    from brigade.launcher import agent

    got = agent.launch(rounds_worker, 2, None)
    calls = got[0]["calls"]
    assert calls[:4] == ["a", "b", "c", "d"]  # warm-up, in turn
    rounds = [calls[4 + 4 * r: 8 + 4 * r] for r in range(3)]
    assert all(sorted(r) == ["a", "b", "c", "d"] for r in rounds) and len(calls) == 16
    assert len({tuple(r) for r in rounds}) > 1  # shuffled, not one fixed order
    assert got[1]["calls"] == calls and got[0]["times"] == got[1]["times"]  # the slowest rank's
    assert all(len(t) == 3 for t in got[0]["times"].values())
    bad = agent.launch(rounds_worker, 2, ["a", "b"])
    assert "different configurations" in bad[0]["error"] and "different configurations" in bad[1]["error"]
