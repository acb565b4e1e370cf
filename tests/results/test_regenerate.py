"""scripts/results.sh at tiny sizes: every job it runs writes the JSON its row in docs/results.md reads."""

import json
import subprocess
from pathlib import Path

import pytest

from brigade.results.regenerate import JOBS
from brigade.results.table import ROWS
from brigade.train.metrics import loop_seconds

ROOT = Path(__file__).resolve().parents[2]
# The jobs that read training runs (their extractors are new code) and a benchmark that writes
# its own JSON; the others run the same code path with other commands.
QUICK = ["main", "snapshot", "restart", "check", "overhead"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_regeneration_writes_every_figure_its_rows_need(tmp_path):
    done = subprocess.run([str(ROOT / "scripts" / "results.sh"), "--quick", "--out", str(tmp_path),
                           "--only", ",".join(QUICK)], capture_output=True, text=True, timeout=880)
    assert done.returncode == 0, done.stderr + done.stdout
    files = {JOBS[name].file for name in QUICK}
    for row in ROWS:
        if row.file in files:
            data = json.loads((tmp_path / row.file).read_text())
            assert row.figure(data), row.file  # every key the figure in docs/results.md needs is there
    main = json.loads((tmp_path / "train/main.json").read_text())
    assert main["steps"] == 4 and main["val_loss_last"] < main["val_loss_first"] + 1
    snap = json.loads((tmp_path / "train/snapshot.json").read_text())
    assert snap["snapshot_every"] == 2 and len(snap["snapshot_s"]) == 3  # steps 2, 4, 6, in the background
    assert snap["final_s"] > 0  # the end's, written at once
    restart = json.loads((tmp_path / "faults/restart.json").read_text())
    assert restart["attempt"] == 1 and restart["resumed_from"] in (2, 4) and restart["first_step_s"] > 0
    overhead = json.loads((tmp_path / "overhead/overhead.json").read_text())
    assert len(overhead["raw_step_s"]) == len(overhead["brigade_step_s"]) == 1


def test_loop_seconds_times_whole_steps_and_skips_evaluation_gaps():
    records = [{"step": 0, "val_loss": 4.0, "time": 0.0},
               {"step": 1, "loss": 3.0, "time": 10.0},
               {"step": 2, "loss": 3.0, "time": 11.0},
               {"step": 2, "event": "snapshot", "seconds": 0.5, "time": 11.6},
               {"step": 3, "loss": 3.0, "time": 12.5},  # the snapshot is inside this step's loop
               {"step": 3, "val_loss": 2.0, "time": 14.0},
               {"step": 4, "loss": 2.0, "time": 15.0},  # after an evaluation: left out
               {"step": 5, "loss": 2.0, "time": 15.5}]
    assert loop_seconds(records) == [1.0, 1.5, 0.5]
    assert loop_seconds(records, skip=2) == [0.5]
