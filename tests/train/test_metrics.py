"""The metrics owner: the reader of metrics.jsonl, the sinks Metrics fans records out to, TensorBoard."""

from __future__ import annotations

import json
import sys

import pytest

from brigade.errors import BrigadeError
from brigade.train import metrics
from brigade.train.metrics import Metrics, last_step, read_records, trim

STEP = {"loss": 3.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0, "step_time_s": 0.25}


def _write(out, *lines: str) -> None:
    (out / "metrics.jsonl").write_text("".join(lines), encoding="utf-8")


def _rec(step: int, **extra) -> str:
    return json.dumps({"step": step, **extra}) + "\n"


def test_read_records_skips_a_torn_last_line(tmp_path):
    _write(tmp_path, _rec(1, loss=3.0), _rec(1, val_loss=2.9), '{"step": 2, "lo')
    assert read_records(tmp_path) == [{"step": 1, "loss": 3.0}, {"step": 1, "val_loss": 2.9}]


def test_read_records_without_a_file_names_the_folder(tmp_path):
    with pytest.raises(BrigadeError, match=f"^{tmp_path} has no metrics.jsonl: give the --out folder"):
        read_records(tmp_path)
    assert read_records(tmp_path, missing_ok=True) == []


def test_last_step_is_the_last_training_record(tmp_path):
    assert last_step(tmp_path) == 0  # no file yet
    _write(tmp_path, _rec(0, val_loss=3.1), _rec(1, loss=3.0), _rec(2, loss=2.9),
           _rec(2, event="snapshot", seconds=0.1), _rec(2, val_loss=2.8), '{"step": 3, "lo')
    assert last_step(tmp_path) == 2
    _write(tmp_path, _rec(0, val_loss=3.1))
    assert last_step(tmp_path) == 0


def test_trim_drops_records_past_the_step_and_torn_lines(tmp_path):
    _write(tmp_path, _rec(1, loss=3.0), _rec(2, loss=2.9), _rec(2, event="snapshot", seconds=0.1),
           _rec(3, loss=2.8), '{"step": 4, "lo')
    trim(tmp_path, 2)
    assert read_records(tmp_path) == [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.9},
                                      {"step": 2, "event": "snapshot", "seconds": 0.1}]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("}\n")
    assert not list(tmp_path.glob("*tmp*"))  # written atomically, nothing left behind


def test_trim_without_a_file_writes_nothing(tmp_path):
    trim(tmp_path, 5)
    assert list(tmp_path.iterdir()) == []


def test_record_kinds():
    records = [{"step": 0, "val_loss": 3.1}, {"step": 1, **STEP}, {"step": 1, "event": "snapshot"},
               {"step": 2, "event": "first_step", "attempt": 1}, {"step": 2, "val_loss": None}]
    assert metrics.training(records) == [records[1]]
    assert metrics.validation(records) == [records[0]]
    assert metrics.events(records, "first_step") == [records[3]]


def test_metrics_appends_stamped_records_after_a_torn_line(tmp_path):
    _write(tmp_path, _rec(1, **STEP), '{"step": 2, "lo')
    with Metrics(tmp_path, total_steps=3) as m:
        m.write({"step": 2, **STEP})
        with m:  # re-entrant: the inner exit keeps the sinks open
            pass
        m.write({"step": 2, "event": "snapshot", "seconds": 0.5})
    m.write({"step": 3, **STEP})  # outside the context: dropped
    records = read_records(tmp_path)
    assert [(r["step"], "event" in r) for r in records] == [(1, False), (2, False), (2, True)]
    assert all(isinstance(r["time"], float) for r in records[1:])


def test_metrics_of_other_ranks_write_nothing(tmp_path, capsys):
    with Metrics(None, total_steps=3, tensorboard=True) as m:
        m.write({"step": 1, **STEP})
    assert capsys.readouterr().out == ""


def test_console_prints_every_log_every_steps_and_validation(tmp_path, capsys):
    with Metrics(tmp_path, total_steps=4, log_every=2) as m:
        for step in range(1, 5):
            m.write({"step": step, **STEP})
        m.write({"step": 4, "val_loss": 2.5})
        m.write({"step": 4, "event": "snapshot", "seconds": 0.1})
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["2/4", "4/4", "4"]
    assert lines[-1].endswith("val loss 2.5000")


@pytest.fixture
def no_tensorboard(monkeypatch):
    """Imports of tensorboard (and torch's wrapper of it) fail, as without the package."""
    for name in [n for n in sys.modules if n.split(".")[0] == "tensorboard"
                 or n.startswith("torch.utils.tensorboard")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)


MISSING = "--tensorboard needs the tensorboard package: pip install 'brigade[tensorboard]'"


def test_without_the_package_tensorboard_is_refused_in_one_line(tmp_path, no_tensorboard):
    with pytest.raises(BrigadeError) as err:
        metrics.require_tensorboard()
    assert str(err.value) == MISSING
    with pytest.raises(BrigadeError, match="needs the tensorboard package"):
        Metrics(tmp_path, total_steps=3, tensorboard=True)
    assert list(tmp_path.iterdir()) == []  # refused before any work
    Metrics(tmp_path, total_steps=3)  # without the flag nothing needs it


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _texts(folder) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [e.step for e in acc.Tensors(tag)] for tag in acc.Tags()["tensors"]}


def test_tensorboard_sink_writes_scalars_and_event_text(tmp_path):
    with Metrics(tmp_path, total_steps=2, tensorboard=True) as m:
        m.write({"step": 0, "val_loss": 3.5})
        for step in (1, 2):
            m.write({"step": step, **STEP, "loss": 3.0 - step})
        m.write({"step": 2, "event": "snapshot", "seconds": 0.5})
        m.write({"step": 2, "event": "first_step", "attempt": 1, "resumed_from": 1})
    got = _scalars(tmp_path / "tensorboard")
    assert got["train/loss"] == [(1, 2.0), (2, 1.0)] and got["val/loss"] == [(0, 3.5)]
    for key, value in STEP.items():
        if key != "loss":
            assert got[f"train/{key}"] == [(1, pytest.approx(value)), (2, pytest.approx(value))]
    assert got["event/snapshot/seconds"] == [(2, 0.5)]
    assert got["event/first_step/attempt"] == [(2, 1.0)]
    assert _texts(tmp_path / "tensorboard") == {"events/snapshot/text_summary": [2],
                                                "events/first_step/text_summary": [2]}


def test_tensorboard_after_a_resume_shows_each_step_once(tmp_path):
    with Metrics(tmp_path, total_steps=4, tensorboard=True) as m:
        for step in (1, 2, 3):
            m.write({"step": step, **STEP, "loss": float(step)})
    trim(tmp_path, 2)  # the run resumes from the snapshot of step 2
    with Metrics(tmp_path, total_steps=4, tensorboard=True) as m:
        for step in (3, 4):
            m.write({"step": step, **STEP, "loss": 10.0 * step})
    assert _scalars(tmp_path / "tensorboard")["train/loss"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_the_flag_comes_from_train_config():
    import argparse

    from brigade import config

    parser = argparse.ArgumentParser()
    config.add_flags(parser)
    assert config.build(parser.parse_args(["--tensorboard"])).train.tensorboard is True
    assert config.build(parser.parse_args([])).train.tensorboard is False


@pytest.mark.timeout(300)
def test_brigade_train_tensorboard_writes_every_metric_at_its_step(tmp_path):
    from tests.e2e.helpers import train

    result = train(tmp_path, "--max-steps", "6", "--snapshot-every", "3", "--sample-tokens", "0",
                   "--tensorboard")
    assert result.returncode == 0, result.stderr
    got = _scalars(tmp_path / "tensorboard")
    for key in STEP:
        assert [s for s, _ in got[f"train/{key}"]] == [1, 2, 3, 4, 5, 6], key
    losses = [r["loss"] for r in metrics.training(read_records(tmp_path))]
    assert [v for _, v in got["train/loss"]] == pytest.approx(losses, rel=1e-6)
    assert [s for s, _ in got["val/loss"]] == [0, 6]  # TINY evaluates every 10 steps and at the end
    assert [s for s, _ in got["event/snapshot/seconds"]] == [3, 6]
    # step 3's written in the background, noticed at a later step's end; step 6's, the last, at once
    assert [v for _, v in got["event/snapshot_written/snapshot_step"]] == [3.0, 6.0]
    assert got["event/first_step/attempt"] == [(1, 0.0)]
    (memory,) = [r for r in read_records(tmp_path) if r.get("event") == "memory"]
    for rank in (0, 1):  # each rank's bytes by kind, once, at step 2
        for kind in ("params", "grads", "optimizer", "activations", "peak"):
            assert got[f"event/memory/rank{rank}/{kind}"] == [(2, memory[f"rank{rank}/{kind}"])], kind
    assert set(_texts(tmp_path / "tensorboard")) == {"events/snapshot/text_summary",
                                                     "events/snapshot_written/text_summary",
                                                     "events/first_step/text_summary",
                                                     "events/memory/text_summary"}


def test_brigade_train_tensorboard_without_the_package_exits_2(cli, tmp_path, no_tensorboard):
    from tests.e2e.helpers import TINY

    result = cli("train", "--out", tmp_path / "run", *TINY, "--tensorboard")
    assert (result.returncode, result.stderr) == (2, f"brigade train: error: {MISSING}\n")
    assert not (tmp_path / "run").exists()
