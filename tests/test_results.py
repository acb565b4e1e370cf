"""docs/results.md's table holds exactly the figures of the JSON files in results/, and the
README's first run quotes the main job's file."""

import json
import re
from pathlib import Path

from brigade.results import page
from brigade.results.regenerate import JOBS, main, select
from brigade.results.table import ROWS, table

ROOT = Path(__file__).resolve().parents[1]


RESULTS_PAGE = ROOT / "docs" / "results.md"


def _results_section() -> str:
    """The page down to its known gaps: the one table of figures, and what they say."""
    text = RESULTS_PAGE.read_text(encoding="utf-8")
    return text[:text.index("## Known gaps")]


def test_results_table_is_the_one_written_from_the_result_files():
    expected = table(ROOT / "results")
    assert expected in _results_section(), (
        "docs/results.md's table differs from the files: run `python -m brigade.results --page`")


def test_every_block_of_the_page_is_what_its_files_give():
    """The table and each paragraph that quotes a figure (brigade/results/page.py): written from
    results/, so prose and file cannot disagree."""
    text = RESULTS_PAGE.read_text(encoding="utf-8")
    assert sorted(page.names(text)) == sorted(page.BLOCKS), "docs/results.md lacks a block or holds an unknown one"
    assert page.render(text, ROOT / "results") == text, \
        "docs/results.md differs from results/: run `python -m brigade.results --page`"


def test_a_changed_figure_changes_its_paragraph(tmp_path):
    import shutil
    shutil.copytree(ROOT / "results", tmp_path / "results")
    data = json.loads((tmp_path / "results/check/check.json").read_text())
    data["max_abs_loss_diff"] = 0.5
    (tmp_path / "results/check/check.json").write_text(json.dumps(data))
    text = RESULTS_PAGE.read_text(encoding="utf-8")
    assert page.render(text, tmp_path / "results") != text


def test_page_without_results_folder_is_refused_in_one_line(tmp_path, capsys):
    assert main(["--page", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--page" in err and "leave out --out" in err


def _first_run() -> list[str]:
    """The console output under the README's "A first run"."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## A first run"):]
    return section.split("```")[1].splitlines()


def test_the_readmes_first_run_quotes_the_main_jobs_file():
    main_job = json.loads((ROOT / "results/train/main.json").read_text(encoding="utf-8"))
    lines = _first_run()
    assert main_job["command"] == "brigade train" and "$ brigade train" in lines
    losses = [line for line in lines if " val loss " in line]
    assert losses == [f"step      0  val loss {main_job['val_loss_first']:.4f}",
                      f"step {main_job['steps']:6d}  val loss {main_job['val_loss_last']:.4f}"], losses
    done = next(line for line in lines if line.startswith("brigade: done"))
    assert f"done at step {main_job['steps']}, validation loss {main_job['val_loss_last']:.4f}." in done
    sample = lines[lines.index("--- sample ---") + 1:lines.index("--------------")]
    shown = [line for line in sample if line.strip() and line != "..."]
    assert shown and all(line in main_job["sample"].splitlines() for line in shown), shown


def test_every_table_row_names_its_file_and_no_other_figure_table_exists():
    section = _results_section()
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| what")]
    assert len(rows) == len(ROWS)
    for line, row in zip(rows, ROWS):
        assert f"| `results/{row.file}` | " in line, line  # then the commit that wrote it
        assert (ROOT / "results" / row.file).is_file(), row.file


def test_every_file_the_table_reads_has_a_job_that_writes_it():
    written = {job.file for job in JOBS.values()}
    assert {row.file for row in ROWS} <= written


def test_a_changed_figure_changes_the_table(tmp_path):
    for row in ROWS:
        dest = tmp_path / row.file
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes((ROOT / "results" / row.file).read_bytes())
    data = json.loads((tmp_path / "faults/restart.json").read_text())
    data["first_step_s"] = 7.654
    (tmp_path / "faults/restart.json").write_text(json.dumps(data))
    assert "7.65 s after its process starts" in table(tmp_path)
    assert table(tmp_path) not in _results_section()


def test_unknown_job_is_one_line_and_exit_2(capsys):
    assert main(["--only", "main,nonsense"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nonsense" in err and "expected names from" in err
    assert select("") == list(JOBS)


def test_quick_figures_never_overwrite_the_results_folder(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["--quick", "--only", "main"]) == 2
    assert re.search(r"--quick .*another --out", capsys.readouterr().err)
