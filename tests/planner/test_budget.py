"""`brigade tune --memory-per-device`: sizes parsed in one line, every configuration's predicted
peak, what does not fit never timed nor chosen; auto's rows planned on their measured costs."""

import json

import pytest

from brigade.errors import BrigadeError
from brigade.models import load_model
from brigade.planner.budget import keep_fitting, parse_bytes, peak_bytes, size_text
from brigade.planner.costs import measure_memory
from brigade.planner.sweep import plan_costs
from tests.e2e.helpers import brigade


@pytest.mark.parametrize("text, want", [("8GiB", 8 * 2**30), ("512MB", 512e6), ("1e9", 1e9),
                                        ("0", 0.0), ("3 KiB", 3072.0), ("10b", 10.0)])
def test_sizes_read_in_bytes(text, want):
    assert parse_bytes(text) == want


@pytest.mark.parametrize("text", ["3XB", "-1", "GiB", "", "1.2.3MB"])
def test_a_size_that_is_not_one_is_refused_in_one_line(text):
    with pytest.raises(BrigadeError, match=r"--memory-per-device .*: expected a size like 8GiB, 512MB"):
        parse_bytes(text)


def test_sizes_print_in_the_largest_unit_they_fill():
    assert [size_text(n) for n in (12, 3 * 2**10, 1.5 * 2**20, 2**31)] == \
        ["12 B", "3.0 KiB", "1.5 MiB", "2.0 GiB"]


@pytest.fixture(scope="module")
def mlp_costs():
    return measure_memory(load_model("mlp", seed=0), 4, ["none"])


def _rows() -> list[dict]:
    return [{"schedule": None, "virtual": 1, "microbatches": 1, "balance": None, "dp": 2, "pp": 1},
            {"schedule": "gpipe", "virtual": 1, "microbatches": 4, "balance": [4, 4], "dp": 1, "pp": 2},
            {"schedule": "1f1b", "virtual": 1, "microbatches": 4, "balance": [4, 4], "dp": 1, "pp": 2}]


BATCH = 1024  # a batch whose activations outweigh the MLP's gradients and AdamW's temporaries


def test_a_pipeline_holds_less_than_the_whole_model_and_1f1b_less_than_gpipe(mlp_costs):
    ddp, gpipe, one_f = (peak_bytes(mlp_costs, r, BATCH) for r in _rows())
    assert ddp > gpipe > one_f > 0
    # at a small batch the states outweigh the activations: the schedules differ by under 1 %
    small = [peak_bytes(mlp_costs, r, 8) for r in _rows()]
    assert small[0] > small[1] >= small[2] > 0.99 * small[1]


def test_what_does_not_fit_is_left_out_and_nothing_fitting_is_one_line(mlp_costs):
    rows = _rows()
    ddp, gpipe, one_f = (peak_bytes(mlp_costs, r, BATCH) for r in rows)
    fit, too_big = keep_fitting(rows, mlp_costs, BATCH, (gpipe + one_f) / 2)
    assert [r["schedule"] for r in fit] == ["1f1b"] and [r["schedule"] for r in too_big] == [None, "gpipe"]
    assert all(r["predicted_peak_bytes"] > (gpipe + one_f) / 2 for r in too_big)
    with pytest.raises(BrigadeError, match=r"no configuration fits; the least \(1f1b, V=1, m=4\) needs"):
        keep_fitting(_rows(), mlp_costs, BATCH, one_f / 2)


@pytest.mark.timeout(300)
def test_tune_never_times_what_would_not_fit_and_plans_auto_on_its_measured_costs(tmp_path, mlp_costs):
    limit = peak_bytes(mlp_costs, _rows()[0], 8) * 0.9  # below data parallel's peak
    out = tmp_path / "tune"
    result = brigade("tune", "--model", "mlp", "--batch-size", "8", "--splits", "2", "--schedules",
                     "gpipe,1f1b,auto", "--repeats", "2", "--memory-per-device", str(int(limit)), "--json",
                     "--out", out, timeout=280)
    assert result.returncode == 0, result.stderr
    written = json.loads((out / "tune.json").read_text())
    too_big = {(r["schedule"], r["virtual"]) for r in written["too_big"]}
    assert (None, 1) in too_big  # data parallel holds the whole model: left out
    assert all(r["predicted_peak_bytes"] > limit for r in written["too_big"])
    assert all("mean_s" not in r for r in written["too_big"])  # never timed
    chosen = written["chosen"]
    assert (chosen["schedule"], chosen["virtual"]) not in too_big and chosen["predicted_peak_bytes"] <= limit
    autos = [r for r in written["predictions"] if r["schedule"] == "auto"]
    assert {r["virtual"] for r in autos} == {1, 2}
    assert all(plan_costs(r) and len(plan_costs(r).forward) == 2 * r["virtual"] for r in autos)
    assert all(plan_costs(r) is None for r in written["predictions"] if r["schedule"] != "auto")
