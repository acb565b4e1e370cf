"""results.tune_robustness: each run's figures from its tune.json, the worst of them, and the file it
writes."""

import json

import pytest

from brigade.results.tune_robustness import main, row_of, summary


def _written(within: float) -> dict:
    ddp = {"schedule": None, "virtual": 1, "microbatches": 1, "dp": 2, "mean_s": 1.6}
    bfs = {"schedule": "looped-bfs", "virtual": 1, "microbatches": 8, "dp": 1, "mean_s": 1.2}
    return {"chosen_label": "ddp, dp=2", "chosen_mean_s": 1.9, "chosen_sweep_mean_s": 1.6,
            "sweep_best_label": "ddp, dp=2", "sweep_best_mean_s": 1.6, "within": within,
            "within_ci": [0.0, 0.1], "sweep": [ddp, bfs]}


def test_a_row_keeps_the_choice_the_best_and_what_the_medians_alone_say():
    row = row_of(3, _written(0.0), [4.0, 3.0, 2.0], [5.0, 3.0, 2.0], 200.0)
    assert (row["run"], row["chosen"], row["sweep_best"], row["within"]) == (3, "ddp, dp=2", "ddp, dp=2", 0.0)
    assert (row["search_s"], row["resweep_s"], row["sweep_best_s"]) == (1.9, 1.6, 1.6)
    assert row["search_over_sweep_best"] == pytest.approx(1.9 / 1.6)
    assert row["lowest_median"] == "looped-bfs, V=1, m=8"  # the rule of old: the lowest median
    assert row["within_of_medians"] == pytest.approx(1.6 / 1.2 - 1)


def test_the_summary_is_the_worst_run_and_the_highest_load():
    rows = [row_of(1, _written(0.01), [1.0] * 3, [2.0] * 3, 1.0),
            row_of(2, _written(0.2), [6.5] * 3, [3.0] * 3, 1.0)]
    got = summary(rows)
    assert (got["runs"], got["worst_run"], got["max_load_1min"]) == (2, 2, 6.5)
    assert got["worst_within"] == 0.2 and got["worst_ratio"] == pytest.approx(1.2)


@pytest.mark.timeout(200)
def test_runs_in_a_row_write_one_file_with_the_command_that_made_it(tmp_path, capsys):
    out = tmp_path / "robust.json"
    args = ["--runs", "1", "--tune-args", "--model toy --batch-size 8 --splits 4,2 --repeats 2",
            "--out", str(out), "--work", str(tmp_path / "work")]
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert data["command"] == ("python -m brigade.results.tune_robustness --runs 1 "
                               "--tune-args '--model toy --batch-size 8 --splits 4,2 --repeats 2'")
    assert len(data["rows"]) == 1 and data["summary"]["runs"] == 1
    assert (tmp_path / "work" / "tune1" / "tune.json").exists() and "worst of 1" in capsys.readouterr().out


def test_no_runs_is_refused_with_what_to_give(capsys):
    with pytest.raises(SystemExit):
        main(["--runs", "0"])
    assert "--runs 0: give 1 or more" in capsys.readouterr().err
