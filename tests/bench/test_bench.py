"""bench and tune: JSON with the promised fields, plots drawn from it, a config train accepts."""

import json

import pytest
import torch
from torch import nn

from brigade.bench.experiments import scaled_splits
from brigade.bench.memory import ActivationMeter
from brigade.bench.plot import table
from brigade.bench.tune import _interpolate, predict
from tests.e2e.helpers import brigade

FIELDS = {"name", "schedule", "virtual", "stages", "microbatches", "split_size", "mean_s", "std_s",
          "median_s", "median_ci", "rounds_s", "speedup_vs_single", "speedup_vs_single_ci",
          "ideal_speedup", "efficiency", "torch_pipelining"}


def test_tutorial_splits_scale_to_the_batch():
    assert scaled_splits(120) == [1, 3, 5, 8, 10, 12, 20, 40, 60]
    assert scaled_splits(32) == [1, 2, 4, 8, 16]


def test_activation_meter_sees_gpipe_hold_more_than_one_microbatch():
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
    xs = [torch.randn(16, 64) for _ in range(4)]
    with ActivationMeter(exclude=list(model.parameters())) as all_first:
        outs = [model(x).sum() for x in xs]  # GPipe: every forward before any backward
        for o in outs:
            o.backward()
    del outs
    with ActivationMeter(exclude=list(model.parameters())) as one_by_one:
        for x in xs:
            model(x).sum().backward()  # 1F1B on one stage: one micro-batch in flight
    assert one_by_one.peak_bytes > 0
    assert all_first.peak_bytes == pytest.approx(4 * one_by_one.peak_bytes, rel=0.01)
    assert one_by_one.live == 0


def test_prediction_balances_and_interpolates():
    samples = {2: [(1.0, 2.0, 1.0)] * 4, 8: [(4.0, 8.0, 4.0)] * 4}
    assert _interpolate(samples, 5) == [(2.5, 5.0, 2.5)] * 4
    seconds, balance = predict(samples, batch=16, m=2, schedule="1f1b", n_stages=2, comm_per_sample=0.0)
    assert balance == [2, 2]
    # size 8: each stage F = 8, B = 16; 1F1B over 2 stages and 2 micro-batches ends at 72
    assert seconds == pytest.approx(72.0)


@pytest.mark.timeout(300)
def test_bench_writes_json_plots_and_a_table(tmp_path):
    out = tmp_path / "bench"
    result = brigade("bench", "--model", "toy", "--batch-size", "8", "--splits", "4,2", "--repeats", "2",
                     "--out", out, timeout=280)
    assert result.returncode == 0, result.stderr
    data = json.loads((out / "bench.json").read_text())
    names = {c["name"] for c in data["configs"]}
    assert names == {"single", "model parallel", "brigade", "torch.distributed.pipelining", "ddp"}
    for c in data["configs"]:
        assert FIELDS <= set(c), c["name"]
        assert len(c["rounds_s"]) == 2 and c["median_ci"][0] <= c["median_s"] <= c["median_ci"][1]
    torch_rows = [c for c in data["configs"] if c["torch_pipelining"]]
    # one stage per rank only: the toy's 3 blocks cannot make the 4 stages of V = 2
    assert {(c["schedule"], c["microbatches"]) for c in torch_rows} == {
        (s, m) for s in ("gpipe", "1f1b", "zb") for m in (2, 4)}
    assert {(s["schedule"], s["virtual"]) for s in data["skipped"]} >= {("interleaved", 2), ("zbv", 2)}
    assert all("blocks" in s["reason"] or "DualPipeV" in s["reason"] for s in data["skipped"])
    ours = [c for c in data["configs"] if c["name"] == "brigade"]
    assert len(ours) == 6 and all(c["efficiency"] > 0 and c["ideal_speedup"] > 0 for c in ours)
    assert all(c["torch_twin"] == c["schedule"] and "vs_torch_ranked" in c for c in ours)
    assert data["best"]["vs_torch_ci"][0] <= data["best"]["vs_torch"] <= data["best"]["vs_torch_ci"][1]
    assert data["ci_coverage"] == 0.5 and "cover 50 %" in result.stdout  # 2 rounds: said, not hidden
    assert all(len(c["peak_activation_bytes"]) == 2 for c in ours)
    assert data["memory_method"] == "saved-tensors" and data["config"]["backend"] == "gloo"  # CPU here
    for name in ("bench_bars.png", "split_size_tradeoff.png", "timeline.png", "memory.png"):
        assert (out / name).stat().st_size > 1000, name
    trace = json.loads((out / "timeline_trace.json").read_text())
    assert {e["tid"] for e in trace["traceEvents"]} == {0, 1}
    assert "speedup" in result.stdout and "torch.distributed.pipelining" in result.stdout


@pytest.mark.timeout(300)
def test_tune_chooses_within_a_third_of_the_sweep_and_writes_a_train_config(tmp_path):
    out = tmp_path / "tune"
    result = brigade("tune", "--model", "toy", "--batch-size", "8", "--splits", "8,4,2,1",
                     "--repeats", "2", "--verify", "--json", "--out", out, timeout=280)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["trials"] <= data["sweep_trials"] / 3 and data["sweep_trials"] == 12
    assert {"schedule", "microbatches", "balance"} <= set(data["chosen"])
    assert data["chosen_mean_s"] > 0 and data["sweep_best_mean_s"] > 0
    assert data["within"] == pytest.approx(data["chosen_sweep_mean_s"] / data["sweep_best_mean_s"] - 1)
    assert data["chosen_sweep_mean_s"] != data["chosen_mean_s"]  # timed again, not copied
    toml = out / "tune.toml"
    text = toml.read_text()
    assert f"microbatches = {data['chosen']['microbatches']}" in text and "pp = 2" in text
    run = brigade("train", "--config", toml, "--max-steps", "2", "--out", tmp_path / "run",
                  "--sample-tokens", "0")
    assert run.returncode == 0, run.stderr


def test_verify_times_the_chosen_configuration_again_with_the_sweep():
    from brigade.bench.tune import verify_sweep

    predictions = [{"schedule": "zb", "microbatches": 8, "balance": [2, 2], "mean_s": 1.0},
                   {"schedule": "1f1b", "microbatches": 4, "balance": [2, 2]},
                   {"schedule": "gpipe", "microbatches": 2, "balance": [1, 3]}]
    chosen = predictions[0]
    # the search's 1.0 s was a lucky draw: timed again, the chosen one is not the best
    again = {"zb": 1.3, "1f1b": 1.2, "gpipe": 2.0}
    timed = []

    def time_config(c):
        timed.append((c["schedule"], c["microbatches"]))
        return again[c["schedule"]]

    result = verify_sweep(predictions, chosen, time_config)
    assert timed == [("zb", 8), ("1f1b", 4), ("gpipe", 2)]  # the chosen one too, once
    assert result["chosen_sweep_mean_s"] == 1.3
    assert result["sweep_best"]["schedule"] == "1f1b" and result["sweep_best_mean_s"] == 1.2
    assert result["within"] == pytest.approx(1.3 / 1.2 - 1)
    zb = next(r for r in result["sweep"] if r["schedule"] == "zb")
    assert zb["mean_s"] == 1.3 and zb["search_mean_s"] == 1.0


def test_median_ci_is_the_order_statistic_interval():
    from brigade.bench.timing import median_ci, median_ci_coverage

    assert median_ci([float(v) for v in range(10, 0, -1)]) == (5.5, 2.0, 9.0)  # x(2)..x(9) of 10
    assert median_ci([1.0, 5.0, 2.0, 4.0, 3.0, 9.0, 7.0, 8.0]) == (4.5, 1.0, 9.0)  # 8: min..max
    assert median_ci_coverage(10) >= 0.95 and median_ci_coverage(5) == pytest.approx(0.9375)
    with pytest.raises(ValueError, match="no values"):
        median_ci([])


def _raw(ours: list[float], theirs: list[float], single: list[float]) -> dict:
    """A worker's result for single, brigade 1f1b and torch's 1f1b at m = 2 over len(ours) rounds."""
    from brigade.bench.experiments import Case

    cases = [Case("single", None, 1, 1), Case("brigade", "1f1b", 1, 2),
             Case("torch.distributed.pipelining", "1f1b", 1, 2)]
    times = dict(zip((c.key for c in cases), (single, ours, theirs), strict=True))
    costs = [([0.1 * t, 0.1 * t], [0.2 * t, 0.2 * t], [0.1 * t, 0.1 * t]) for t in ours]
    return {"cases": [c.__dict__ for c in cases], "skipped": [], "ranks": 2, "times": times,
            "balances": {1: [1, 2]}, "memory": {}, "costs": {(1, 2): costs}, "trace": None}


def test_ratios_per_round_cancel_drift_that_hits_every_configuration():
    from brigade.bench.experiments import BenchConfig
    from brigade.bench.figures import summarise

    drift = [1 + 0.5 * k for k in range(10)]  # the machine slows down 5.5× during the run
    data = summarise(BenchConfig(batch_size=8, rounds=10),
                     _raw([d for d in drift], [1.1 * d for d in drift], [2 * d for d in drift]), "cpu")
    ours = next(c for c in data["configs"] if c["name"] == "brigade")
    assert ours["speedup_vs_single"] == pytest.approx(2.0) and ours["speedup_vs_single_ranked"]
    assert ours["vs_torch"] == pytest.approx(1.1) and ours["vs_torch_ci"] == pytest.approx([1.1, 1.1])
    assert ours["vs_torch_ranked"] and data["best"]["vs_torch_ranked"]
    # simulate(): 1F1B, 2 stages, 2 micro-batches, F = 0.1 t, B = 0.2 t: 0.9 t, every round
    assert ours["efficiency"] == pytest.approx(0.9) and ours["ideal_s"] == pytest.approx(0.9 * 3.25)
    assert ours["std_s"] > 0.4 * ours["mean_s"]  # the raw times are all over the place


def test_a_spread_too_large_to_rank_is_said():
    from brigade.bench.experiments import BenchConfig
    from brigade.bench.figures import summarise
    from brigade.bench.run import best_line

    ours = [1.0] * 10
    theirs = [0.9, 1.1] * 5  # torch faster in half the rounds, slower in the others
    data = summarise(BenchConfig(batch_size=8, rounds=10), _raw(ours, theirs, [2.0] * 10), "cpu")
    row = next(c for c in data["configs"] if c["name"] == "brigade")
    assert row["vs_torch_ci"] == pytest.approx([0.9, 1.1]) and row["vs_torch_ranked"] is False
    assert best_line(data["best"]).startswith("cannot rank")
    assert "1.00?" in table(data)  # the row's vs-torch figure is marked: cannot rank


def test_configurations_are_schedule_virtual_m_with_reasons_for_the_skipped():
    from brigade.bench.experiments import BenchConfig, cases
    from brigade.bench.peers import TORCH_SCHEDULES

    cfg = BenchConfig(model="mlp", batch_size=8, splits=[4, 2])
    run, skipped = cases(cfg, ranks=2, n_blocks=8)
    rows = {(c.name, c.schedule, c.virtual, c.microbatches) for c in run}
    assert ("brigade", "interleaved", 2, 4) in rows and ("brigade", "1f1b", 1, 2) in rows
    assert ("torch.distributed.pipelining", "zbv", 2, 4) in rows or "zbv" not in TORCH_SCHEDULES
    assert ("torch.distributed.pipelining", "dualpipev", 2, 2) not in rows
    assert any(s["schedule"] == "dualpipev" and "m >= 4" in s["reason"] for s in skipped)
    _, few_blocks = cases(cfg, ranks=2, n_blocks=3)
    assert any(s["name"] == "brigade" and "3 blocks" in s["reason"] for s in few_blocks)
    only_gpipe, _ = cases(BenchConfig(batch_size=8, splits=[2], schedules=["gpipe"]), 2, 8)
    assert {c.schedule for c in only_gpipe if c.name == "torch.distributed.pipelining"} >= {"gpipe"}
    assert "1f1b" not in {c.schedule for c in only_gpipe}


def test_quick_times_fewer_configurations_not_fewer_rounds():
    from argparse import Namespace

    from brigade.bench.run import bench_config

    args = dict(model="gpt", batch_size=None, image_size=None, repeats=None, splits=None,
                schedules="gpipe,1f1b", quick=False)
    full, quick = bench_config(Namespace(**args)), bench_config(Namespace(**{**args, "quick": True}))
    assert quick.rounds == full.rounds == 10
    assert full.splits == [] and len(quick.splits) < len(scaled_splits(full.batch_size))


def rounds_worker(keys_of_rank1: list[str] | None) -> dict:
    import torch.distributed as dist

    from brigade import groups
    from brigade.bench.timing import interleaved_rounds

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
    from brigade import agent

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
