"""scripts/results.sh at tiny sizes: every job it runs writes the JSON its row in docs/results.md reads."""

import json
import subprocess
from pathlib import Path

import pytest

from brigade.results import provenance
from brigade.results.regenerate import JOBS, Job, _transparency, run_job
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


def test_a_job_writes_its_file_stamped_with_its_command_and_commit(tmp_path):
    """Whichever way the figures came (a command that writes its own JSON, here), the file says
    what wrote it: the command as the page shows it, and the code it ran (`measured_at`)."""
    script = "import json, pathlib, sys; p = pathlib.Path(sys.argv[-1]); p.mkdir(parents=True); " \
             "(p / 'f.json').write_text(json.dumps({'figure': 1}))"
    job = Job(f'python -c "{script}"', "own/f.json")
    data = json.loads(run_job("own", job, tmp_path, quick=False).read_text())
    stamp = data.pop("measured_at")  # the tree may change beside it (other tests' files): compare the commit
    assert data == {"command": job.command, "figure": 1}
    assert stamp.split("+")[0] == provenance.commit().split("+")[0] and stamp != "unknown"


PYTEST_RA = """
PASSED tests/train/test_trainer.py::test_layouts_match_a_single_device[dp2]
FAILED tests/train/test_trainer.py::test_layouts_match_a_single_device[tp2]
PASSED tests/train/test_trainer.py::test_context_parallel_trains_in_bf16_as_fp32_does[autocast]
PASSED tests/train/test_trainer.py::test_gradient_accumulation_matches_one_big_batch
1 failed, 3 passed in 9.0s
"""


def test_the_transparency_figures_keep_fp32_and_bf16_apart_with_their_tolerances():
    d = _transparency(Path("."), PYTEST_RA, 1, 9.0)
    assert (d["fp32"]["passed"], d["fp32"]["failed"], d["fp32"]["tolerance"]) == (2, 1, 1e-5)
    assert d["fp32"]["cases"] == ["layouts_match_a_single_device[dp2]", "layouts_match_a_single_device[tp2]",
                                  "gradient_accumulation_matches_one_big_batch"]
    assert (d["bf16"]["passed"], d["bf16"]["failed"], d["bf16"]["tolerance"]) == (1, 0, 0.05)
    table_row = next(r for r in ROWS if r.file == "check/transparency.json")
    assert "1 FAIL" in table_row.figure(d) and "within 0.05 of fp32" in table_row.figure(d)

