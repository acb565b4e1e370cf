"""The experiment trackers (brigade/train/trackers.py): each number of a record under its tag at
its step, the run's id kept so a restart goes on in the same tracked run, and a missing package
refused in one line. MLflow runs for real on a file store; W&B's calls are checked on a stand-in
module here (its offline files are not a format to read back), and for real, offline, by
tests/e2e/test_train.py."""

import sys
import types

import pytest

from brigade.errors import BrigadeError
from brigade.train import trackers

RECORDS = [{"step": 1, "loss": 4.0, "lr": 1e-3, "samples": "ab12", "time": 1.0},
           {"step": 2, "loss": 3.5, "lr": 2e-3, "mfu": 0.25, "time": 2.0},
           {"step": 2, "val_loss": 3.75, "time": 2.5},
           {"step": 2, "event": "snapshot", "seconds": 0.5, "async": True, "time": 3.0}]
TAGGED = [{"train/loss": 4.0, "train/lr": 1e-3}, {"train/loss": 3.5, "train/lr": 2e-3, "train/mfu": 0.25},
          {"val/loss": 3.75}, {"event/snapshot/seconds": 0.5}]


@pytest.mark.parametrize("name,extra", [("wandb", "brigade[wandb]"), ("mlflow", "brigade[mlflow]")])
def test_a_missing_package_is_one_line_that_says_how_to_install_it(monkeypatch, name, extra):
    monkeypatch.setitem(sys.modules, name, None)  # import fails as where it is not installed
    with pytest.raises(BrigadeError) as refused:
        trackers.require((name,))
    assert str(refused.value) == f"--log {name} needs the {name} package: pip install '{extra}'"


def _fake_wandb(calls: list):
    run = types.SimpleNamespace(log=lambda values, step: calls.append(("log", values, step)),
                                finish=lambda: calls.append(("finish",)))
    return types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or run)


def test_wandb_gets_each_number_at_its_step_and_a_restart_the_same_run(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.toml").write_text("[train]\nmax_steps = 2\n")
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    for _ in range(2):  # the first attempt, then a restart in the same folder
        sink = trackers.WandbSink(out)
        for record in RECORDS:
            sink.write(record)
        sink.close()
    inits = [c[1] for c in calls if c[0] == "init"]
    assert inits[0]["id"] == inits[1]["id"] == (out / trackers.WANDB_ID).read_text().strip()
    assert inits[0]["resume"] == "allow" and inits[0]["project"] == "brigade" and inits[0]["name"] == "run"
    assert inits[0]["config"] == {"train": {"max_steps": 2}} and inits[0]["dir"] == str(out)
    logged = [(values, step) for kind, *rest in calls if kind == "log" for values, step in [rest]]
    assert logged[:4] == [(t, r["step"]) for t, r in zip(TAGGED, RECORDS)]


@pytest.mark.full  # MLflow's import and file store: 5-10 s
def test_mlflow_keeps_every_number_and_a_restart_goes_on_in_the_same_run(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.toml").write_text("[optim]\nlr = 0.003\n")
    for records in (RECORDS[:2], [{"step": 3, "loss": 3.25, "time": 4.0}]):  # then a restart
        sink = trackers.MLflowSink(out)
        for record in records:
            sink.write(record)
        sink.close()
    client = MlflowClient((out / trackers.MLFLOW_DIR).resolve().as_uri())
    run = client.get_run((out / trackers.MLFLOW_ID).read_text().strip())
    assert run.data.params == {"optim.lr": "0.003"} and run.info.run_name == "run"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss"))
    assert history == [(1, 4.0), (2, 3.5), (3, 3.25)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "train/mfu")] == [0.25]
