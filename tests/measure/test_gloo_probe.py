"""This host's gloo probe (`measure.gloo_probe`): the rates fitted through two sizes, the
collectives priced as DDP and FSDP issue them, and the runtime's own time per action and step."""

import pytest

from brigade.measure.gloo_probe import as_issued, fit_rates, runtime, tensor_parallel


def test_the_gloo_probe_fits_bandwidth_and_latency_through_two_sizes():
    # 2 ring steps of 1 ms each, 1 GB/s: 1 MB takes 3 ms, 9 MB 11 ms
    assert fit_rates([3e-3, 11e-3], [1e6, 9e6], 2) == (pytest.approx(1e9), pytest.approx(1e-3))
    assert fit_rates([0.5e-3, 8.5e-3], [1e6, 9e6], 1)[1] == 0.0  # below the line: noise, read as none


def test_the_probe_prices_collectives_as_ddp_and_fsdp_issue_them():
    bare = {"coll_latency": 1e-3, "all_reduce_bw": 1e9, "reduce_scatter_bw": 1e9, "all_gather_bw": 0.5e9}
    # DDP added 22 ms to a step of 16 MB of gradients: 16 MB ÷ (22 - 2·1) ms = 0.8 GB/s
    # FSDP (one stage: each of 4 units gathered for its forward and its backward, and reduced)
    # added 92 ms: 12 ms of latency, 80 ms against a bare 8 + 2 × 16 = 40 ms: both at half the rate
    got = as_issued(bare, {"plain": 0.1, "ddp": 0.122, "fsdp": 0.192}, 16e6)
    assert got == {"all_reduce_bw": pytest.approx(0.8e9), "reduce_scatter_bw": pytest.approx(0.5e9),
                   "all_gather_bw": pytest.approx(0.25e9)}
    # FSDP2's own copies and hooks (timed with its collectives free: 40 ms) are priced apart
    own = as_issued(bare, {"plain": 0.1, "ddp": 0.122, "fsdp": 0.232, "fsdp_own": 0.04}, 16e6)
    assert own["reduce_scatter_bw"] == pytest.approx(0.5e9) and own["all_gather_bw"] == pytest.approx(0.25e9)
    # noise: nothing added, or less than the bare rates would take: the bare rates stand
    assert as_issued(bare, {"plain": 0.1, "ddp": 0.099, "fsdp": 0.11}, 16e6) == {}
    assert as_issued(bare, {"plain": 0.1, "ddp": 0.11, "fsdp": 0.11}, 16e6) == {}  # 2 GB/s: above bare


def test_the_probe_fits_the_runtimes_time_per_action_and_per_step():
    # 1F1B, 2 stages: 6 actions on the critical path at m 2, 18 at m 8
    assert runtime([6 * 0.002 + 0.01, 18 * 0.002 + 0.01]) == (pytest.approx(0.002), pytest.approx(0.01))
    assert runtime([0.05, 0.04]) == (0.0, 0.05)  # noise: no negative time


def test_the_probe_prices_a_tp_collective_as_the_blocks_step_issues_it():
    # 20 collectives took the step from 30 ms (free) to 70 ms, and to 110 ms with every core busy
    assert tensor_parallel(0.03, 0.07, 20, 0.11) == {"tp_collective_s": pytest.approx(0.002),
                                                      "crowded_tp_collective_s": pytest.approx(0.004)}
    # noise: the real step faster than the fake one reads as 0; crowded never below uncrowded
    assert tensor_parallel(0.03, 0.02, 20, 0.02) == {"tp_collective_s": 0.0, "crowded_tp_collective_s": 0.0}
    assert tensor_parallel(0.03, 0.07, 20, 0.05)["crowded_tp_collective_s"] == pytest.approx(0.002)


def test_the_probe_listens_below_the_kernels_ephemeral_range(monkeypatch):
    """A port the kernel picked (in its ephemeral range) was once taken by a neighbouring test's
    connection before the probe's store listened, and the probe waited out its 300 s."""
    from brigade.host.net import ephemeral_start
    from brigade.measure import gloo_probe

    started = []

    class Done:
        returncode = 0

        def __init__(self, argv, **kw):
            started.append(argv)

        def communicate(self, timeout):
            return '{"ok": 1}', ""

    monkeypatch.setattr(gloo_probe.subprocess, "Popen", Done)
    assert gloo_probe._run() == {"ok": 1}
    ports = {int(argv[-1]) for argv in started}
    assert len(started) == 2 and len(ports) == 1 and ports.pop() < ephemeral_start()
