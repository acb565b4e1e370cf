"""loss.png from metrics.jsonl, through the metrics reader."""

import pytest

from brigade.errors import BrigadeError
from brigade.train.plot import loss_curves, plot_run


def test_loss_curves_split_training_and_validation():
    records = [{"step": 0, "val_loss": 3.1}, {"step": 1, "loss": 3.0, "lr": 0.1},
               {"step": 1, "event": "snapshot", "seconds": 0.1}, {"step": 2, "loss": 2.5, "lr": 0.1},
               {"step": 2, "val_loss": 2.7}]
    assert loss_curves(records) == ([(1, 3.0), (2, 2.5)], [(0, 3.1), (2, 2.7)])


def test_plot_of_a_folder_without_metrics_names_it(tmp_path):
    with pytest.raises(BrigadeError, match=f"^{tmp_path} has no metrics.jsonl"):
        plot_run(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_nothing_to_plot_yet(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "lo')
    assert plot_run(tmp_path) is None and not (tmp_path / "loss.png").exists()
