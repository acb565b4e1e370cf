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
