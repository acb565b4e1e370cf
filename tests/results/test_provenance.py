"""brigade/results/provenance.py: the commit a results file was written at, and whether the tree
differed from it outside results/."""

import subprocess

from brigade.results import provenance


def _git(root, *args):
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def test_a_clean_tree_is_its_commit_and_changes_outside_results_are_said(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "a.json").write_text("{}\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert provenance.commit(tmp_path) == head
    (tmp_path / "results" / "a.json").write_text('{"new": 1}\n')  # what the runs write: still clean
    assert provenance.commit(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert provenance.commit(tmp_path) == f"{head}+changes"


def test_outside_a_checkout_it_is_unknown(tmp_path):
    assert provenance.commit(tmp_path) == "unknown"


def test_the_table_shows_the_commit_or_that_none_was_recorded():
    assert provenance.measured_at({"measured_at": "abc1234"}) == "`abc1234`"
    assert provenance.measured_at({}) == "not recorded"
    assert provenance.measured_at({"committed_in": "abc1234"}) == \
        "at or before `abc1234` (committed there, not stamped)"


def test_every_table_file_names_the_code_it_came_from_and_that_commit_is_in_the_history():
    """A file of the results table is stamped (`measured_at`) or says the commit it was committed
    in (`committed_in`, for files written before the stamp): a commit of this history."""
    import json
    from pathlib import Path

    from brigade.results.table import ROWS

    root = Path(__file__).resolve().parents[2]
    for file in sorted({row.file for row in ROWS}):
        data = json.loads((root / "results" / file).read_text())
        assert "measured_at" in data or "committed_in" in data, f"results/{file} names no commit"
        if "committed_in" in data:
            known = subprocess.run(["git", "-C", str(root), "merge-base", "--is-ancestor",
                                    data["committed_in"], "HEAD"], capture_output=True)
            assert known.returncode == 0, f"results/{file}: {data['committed_in']} is not in this history"
