"""bench and tune: JSON with the promised fields, plots drawn from it, a config train accepts."""

import json
import statistics

import pytest
import torch

from brigade.bench.cases import scaled_splits
from brigade.bench.plot import table
from brigade.models import load_model
from tests.e2e.helpers import brigade

FIELDS = {"name", "schedule", "virtual", "stages", "microbatches", "split_size", "mean_s", "std_s",
          "median_s", "median_ci", "rounds_s", "speedup_vs_single", "speedup_vs_single_ci",
          "ideal_speedup", "efficiency", "torch_pipelining"}


def test_tutorial_splits_scale_to_the_batch():
    assert scaled_splits(120) == [1, 3, 5, 8, 10, 12, 20, 40, 60]
    assert scaled_splits(32) == [1, 2, 4, 8, 16]


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
    # gpipe, 1f1b, zb and auto (V = 1: it runs at every V it takes), at m = 2 and 4
    assert {(c["schedule"], c["virtual"], c["microbatches"]) for c in ours} == {
        (s, 1, m) for s in ("gpipe", "1f1b", "zb", "auto") for m in (2, 4)}
    assert all(c["efficiency"] > 0 and c["ideal_speedup"] > 0 for c in ours)
    assert all(c["torch_twin"] == c["schedule"] and "vs_torch_ranked" in c
               for c in ours if c["schedule"] != "auto")
    assert all("torch_twin" not in c for c in ours if c["schedule"] == "auto")  # torch has no twin
    # auto's rows run on the cut it chose with its plan, said in bench.json and in a line each
    autos = [c for c in ours if c["schedule"] == "auto"]
    assert all(c["balance"] == c["cut_search"]["cut"] == data["balances"][f"V1 m{c['microbatches']} auto"]
               and c["cut_search"]["simulated_s"] <= c["cut_search"]["solver_simulated_s"] for c in autos)
    assert result.stdout.count(" auto: cut [") == len(autos) == 2
    assert data["best"]["vs_torch_ci"][0] <= data["best"]["vs_torch"] <= data["best"]["vs_torch_ci"][1]
    assert data["ci_coverage"] == 0.5 and "cover 50 %" in result.stdout  # 2 rounds: said, not hidden
    assert all(len(c["peak_activation_bytes"]) == 2 for c in ours)
    # per stage, its parameters' and gradients' bytes too, in all the toy's fp32 parameters
    toy = sum(p.numel() * 4 for b in load_model("toy").blocks for p in b.parameters())
    assert all(sum(c["params_bytes"]) == sum(c["grads_bytes"]) == toy for c in ours)
    assert data["memory_method"] == "saved-tensors" and data["config"]["backend"] == "gloo"  # CPU here
    assert data["freed_memory_kept"] is True  # glibc on Linux, as on CI (see brigade.host.malloc)
    for name in ("bench_bars.png", "split_size_tradeoff.png", "timeline.png", "memory.png"):
        assert (out / name).stat().st_size > 1000, name
    trace = json.loads((out / "timeline_trace.json").read_text())
    assert {e["tid"] for e in trace["traceEvents"]} == {0, 1}
    assert "speedup" in result.stdout and "torch.distributed.pipelining" in result.stdout


ROW = {"schedule", "virtual", "microbatches", "balance", "dp", "pp", "predicted_s"}


@pytest.mark.timeout(300)
def test_tune_searches_schedule_v_m_and_data_parallel_within_a_third_and_writes_a_train_config(tmp_path):
    out = tmp_path / "tune"
    result = brigade("tune", "--model", "mlp", "--batch-size", "8", "--splits", "4,2",
                     "--schedules", "1f1b,interleaved,zbv", "--repeats", "2", "--verify", "--json",
                     "--out", out, timeout=280)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    written = json.loads((out / "tune.json").read_text())
    rows = written["predictions"]
    # 1f1b (V 1), interleaved (V 1 and 2), zbv (V 2), each at m = 2 and 4; and DDP
    assert {(r["schedule"], r["virtual"], r["microbatches"], r["dp"], r["pp"]) for r in rows} == {
        *((s, v, m, 1, 2) for s, v in (("1f1b", 1), ("interleaved", 1), ("interleaved", 2), ("zbv", 2))
          for m in (2, 4)), (None, 1, 1, 2, 1)}
    assert all(ROW <= set(r) and r["predicted_s"] > 0 for r in rows)
    assert all(len(r["balance"]) == 2 * r["virtual"] and sum(r["balance"]) == 8 for r in rows if r["pp"] == 2)
    assert data["left_out"] == [] and data["sweep_trials"] == 9 and data["trials"] <= 9 / 3
    assert sum("mean_s" in r for r in rows) == data["trials"]  # only the trials were timed
    assert sum("final_rounds_s" in r for r in rows) == data["finalists"]  # timed again
    assert 2 <= data["finalists"] <= data["trials"]
    assert data["chosen_mean_s"] > 0 and data["sweep_best_mean_s"] > 0
    from brigade.bench.tune import row_key

    by_key = {row_key(r): r for r in written["sweep"]}
    mine, best = by_key[row_key(data["chosen"])], by_key[row_key(data["sweep_best"])]
    assert best["relative"] == min(r["relative"] for r in written["sweep"])  # ranked within rounds
    assert data["within"] == pytest.approx(  # the median round's ratio, not a ratio of medians
        statistics.median(a / b for a, b in zip(mine["rounds_s"], best["rounds_s"])) - 1)
    assert data["chosen_sweep_mean_s"] != data["chosen_mean_s"]  # timed again, not copied
    text = (out / "tune.toml").read_text()
    assert f"microbatches = {data['chosen']['microbatches']}" in text
    assert f"pp = {data['chosen']['pp']}" in text and f"dp = {data['chosen']['dp']}" in text
    run = brigade("train", "--config", out / "tune.toml", "--max-steps", "2", "--out", tmp_path / "run",
                  "--sample-tokens", "0")
    assert run.returncode == 0, run.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("chosen", [
    {"schedule": "interleaved", "virtual": 2, "microbatches": 2, "balance": [1, 3, 2, 2], "dp": 1, "pp": 2},
    {"schedule": None, "virtual": 1, "microbatches": 1, "balance": None, "dp": 2, "pp": 1},
], ids=["interleaved-V2", "ddp"])
def test_a_chosen_pipeline_with_two_stages_per_rank_or_data_parallel_trains_from_tune_toml(tmp_path, chosen):
    from brigade.bench.cases import BenchConfig
    from brigade.bench.run import _train_config
    from brigade.config import to_toml

    toml = tmp_path / "tune.toml"
    toml.write_text(to_toml(_train_config(BenchConfig(model="mlp", batch_size=8), chosen)))
    run = brigade("train", "--config", toml, "--max-steps", "1", "--out", tmp_path / "run",
                  "--sample-tokens", "0", "--snapshot-every", "0")
    assert run.returncode == 0, run.stderr
    from brigade.config import load_toml

    used = load_toml(tmp_path / "run" / "config.toml")["parallel"]  # what the run resolved and trained with
    assert (used["dp"], used["pp"]) == (chosen["dp"], chosen["pp"])
    if chosen["pp"] > 1:
        assert (used["schedule"], used["virtual"], used["balance"]) == ("interleaved", 2, "1,3,2,2")


def test_verify_times_the_chosen_configuration_again_with_the_sweep():
    from brigade.bench.tune import verify_sweep

    predictions = [{"schedule": "zbv", "virtual": 2, "microbatches": 8, "dp": 1, "balance": [1, 1, 1, 1],
                    "mean_s": 1.0},
                   {"schedule": "interleaved", "virtual": 2, "microbatches": 4, "dp": 1,
                    "balance": [1, 1, 1, 1]},
                   {"schedule": "interleaved", "virtual": 1, "microbatches": 4, "dp": 1, "balance": [2, 2]},
                   {"schedule": None, "virtual": 1, "microbatches": 1, "dp": 2, "balance": None}]
    chosen = predictions[1]
    # the search's 1.0 s for zbv was a lucky draw: timed again, it is not the best
    again = {("zbv", 2): 1.3, ("interleaved", 2): 1.25, ("interleaved", 1): 1.2, (None, 1): 2.0}
    drift = [1.0, 2.0, 1.0, 1.5, 1.0, 1.0]  # per round, hitting every configuration alike
    timed = []

    def time_all(rows):
        timed.append([(r["schedule"], r["virtual"]) for r in rows])
        return [[again[r["schedule"], r["virtual"]] * d for d in drift] for r in rows]

    result = verify_sweep(predictions, chosen, time_all)
    assert timed == [[("zbv", 2), ("interleaved", 2), ("interleaved", 1), (None, 1)]]  # together, once
    assert result["chosen_sweep_mean_s"] == 1.25  # the chosen V = 2 row, not its V = 1 twin
    assert result["sweep_best"]["virtual"] == 1 and result["sweep_best_mean_s"] == 1.2
    assert result["within"] == pytest.approx(1.25 / 1.2 - 1)
    assert result["within_ci"] == pytest.approx([1.25 / 1.2 - 1] * 2)  # per-round ratios: drift cancels
    assert result["within_ci_coverage"] == pytest.approx(0.96875)  # 6 rounds: the 95 % interval
    zbv = next(r for r in result["sweep"] if r["schedule"] == "zbv")
    assert zbv["mean_s"] == 1.3 and zbv["search_mean_s"] == 1.0


def _raw(ours: list[float], theirs: list[float], single: list[float]) -> dict:
    """A worker's result for single, brigade 1f1b and torch's 1f1b at m = 2 over len(ours) rounds."""
    from brigade.bench.cases import Case

    cases = [Case("single", None, 1, 1), Case("brigade", "1f1b", 1, 2),
             Case("torch.distributed.pipelining", "1f1b", 1, 2)]
    times = dict(zip((c.key for c in cases), (single, ours, theirs), strict=True))
    costs = [([0.1 * t, 0.1 * t], [0.2 * t, 0.2 * t], [0.1 * t, 0.1 * t], [0.1 * t, 0.1 * t]) for t in ours]
    return {"cases": [c.__dict__ for c in cases], "skipped": [], "ranks": 2, "times": times,
            "balances": {(1, 2, ""): [1, 2]}, "memory": {}, "costs": {(1, 2, ""): costs}, "trace": None}


def test_ratios_per_round_cancel_drift_that_hits_every_configuration():
    from brigade.bench.cases import BenchConfig
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
    # any plan: rank 1 waits F (0.1 t), then runs 2 × (F + B) = 0.6 t; spread evenly, 0.6 t a rank
    assert ours["lower_bound_s"] == pytest.approx(0.7 * 3.25)
    assert ours["balanced_bound_s"] == pytest.approx(0.6 * 3.25)
    assert data["best"]["bound_vs_torch"] == pytest.approx(1.1 / 0.7)
    assert data["best"]["balanced_bound_vs_torch"] == pytest.approx(1.1 / 0.6)


def test_a_spread_too_large_to_rank_is_said():
    from brigade.bench.cases import BenchConfig
    from brigade.bench.figures import summarise
    from brigade.bench.run import best_line

    ours = [1.0] * 10
    theirs = [0.9, 1.1] * 5  # torch faster in half the rounds, slower in the others
    data = summarise(BenchConfig(batch_size=8, rounds=10), _raw(ours, theirs, [2.0] * 10), "cpu")
    row = next(c for c in data["configs"] if c["name"] == "brigade")
    assert row["vs_torch_ci"] == pytest.approx([0.9, 1.1]) and row["vs_torch_ranked"] is False
    assert best_line(data["best"]).startswith("cannot rank")
    assert "1.00?" in table(data)  # the row's vs-torch figure is marked: cannot rank


def test_fewer_than_six_rounds_never_rank_even_when_every_round_agrees():
    from brigade.bench.cases import BenchConfig
    from brigade.bench.figures import summarise

    data = summarise(BenchConfig(batch_size=8, rounds=5), _raw([1.0] * 5, [1.5] * 5, [2.0] * 5), "cpu")
    row = next(c for c in data["configs"] if c["name"] == "brigade")
    assert row["vs_torch"] == pytest.approx(1.5) and row["vs_torch_ranked"] is False
    assert data["ci_coverage"] == pytest.approx(0.9375)


def test_configurations_are_schedule_virtual_m_with_reasons_for_the_skipped():
    from brigade.bench.cases import BenchConfig, cases
    from brigade.bench.peers import TORCH_SCHEDULES

    cfg = BenchConfig(model="mlp", batch_size=8, splits=[4, 2])
    run, skipped = cases(cfg, ranks=2, n_blocks=8)
    rows = {(c.name, c.schedule, c.virtual, c.microbatches) for c in run}
    assert ("brigade", "interleaved", 2, 4) in rows and ("brigade", "1f1b", 1, 2) in rows
    assert ("torch.distributed.pipelining", "zbv", 2, 4) in rows or "zbv" not in TORCH_SCHEDULES
    assert ("torch.distributed.pipelining", "dualpipev", 2, 2) not in rows
    assert ("brigade", "dualpipev", 2, 2) in rows  # brigade's runs any m; torch's needs m >= 2p
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


@pytest.mark.parametrize("gpus,backend", [(0, "gloo"), (1, "gloo"), (2, "nccl")])
def test_bench_uses_nccl_only_with_a_gpu_per_process(monkeypatch, gpus, backend):
    from argparse import Namespace

    from brigade.bench.run import bench_config

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    args = Namespace(model="toy", image_size=None, batch_size=8, repeats=1, quick=True, splits="",
                     schedules="1f1b")
    assert bench_config(args).backend == backend


def test_auto_rows_run_on_their_own_cut_and_every_other_row_shares_the_solvers():
    from brigade.bench.cases import Case, shape_of

    torch_zbv = Case("torch.distributed.pipelining", "zbv", 2, 8)
    assert shape_of(Case("brigade", "auto", 2, 8)) == (2, 8, "auto")
    assert shape_of(Case("brigade", "zbv", 2, 8)) == shape_of(torch_zbv) == (2, 8, "")
    assert shape_of(Case("single", None, 1, 1)) == shape_of(Case("model parallel", "gpipe", 1, 1)) \
        == (1, 1, "")


def test_bench_json_reports_the_cut_auto_chose_and_the_table_says_it():
    """An auto row's balance, costs and bounds are those of its own cut; bench.json names each cut
    by its shape and carries the search; the bench prints one line for it."""
    from brigade.bench.cases import BenchConfig, Case
    from brigade.bench.figures import summarise
    from brigade.bench.plot import cut_lines

    raw = _raw([1.0] * 6, [1.1] * 6, [2.0] * 6)
    auto = Case("brigade", "auto", 1, 2)
    raw["cases"].append(auto.__dict__)
    raw["times"][auto.key] = [0.9] * 6
    raw["balances"][1, 2, "auto"] = [2, 1]
    raw["costs"][1, 2, "auto"] = [([0.1, 0.05], [0.2, 0.1], [0.1, 0.05], [0.1, 0.05])] * 6
    raw["cut_search"] = {(1, 2, "auto"): {"cut": [2, 1], "solver_cut": [1, 2], "simulated_s": 0.5,
                                          "solver_simulated_s": 0.6, "lower_bound_s": 0.45, "screened": 2,
                                          "weighed": 2, "proven": True}}
    data = summarise(BenchConfig(batch_size=8, rounds=6), raw, "cpu")
    row = next(c for c in data["configs"] if c["schedule"] == "auto")
    assert row["balance"] == [2, 1] and row["cut_search"]["solver_cut"] == [1, 2]
    assert row["stage_forward_s"] == [0.1, 0.05]  # its own cut's stages, probed
    assert data["balances"] == {"V1 m2": [1, 2], "V1 m2 auto": [2, 1]}
    assert cut_lines(data) == ["V1 m2 auto: cut [2, 1] (the solver's [1, 2]), simulated 0.5000 s against "
                               "0.6000 s (best over every cut)"]
