"""bench and tune: JSON with the promised fields, plots drawn from it, a config train accepts."""

import json

import pytest
import torch
from torch import nn

from brigade.bench.experiments import scaled_splits
from brigade.bench.memory import ActivationMeter
from brigade.bench.tune import _interpolate, predict
from tests.e2e.helpers import brigade

FIELDS = {"name", "schedule", "stages", "microbatches", "split_size", "mean_s", "std_s",
          "speedup_vs_single", "ideal_speedup", "efficiency", "torch_pipelining"}


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
    torch_rows = [c for c in data["configs"] if c["torch_pipelining"]]
    assert {(c["schedule"], c["microbatches"]) for c in torch_rows} == {("gpipe", 2), ("gpipe", 4),
                                                                         ("1f1b", 2), ("1f1b", 4)}
    ours = [c for c in data["configs"] if c["name"] == "brigade"]
    assert len(ours) == 6 and all(c["efficiency"] > 0 and c["ideal_speedup"] > 0 for c in ours)
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
