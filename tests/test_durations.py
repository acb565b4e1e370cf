"""scripts/durations.py: a JUnit report summed by file and by test, and a missing report refused."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("durations", ROOT / "scripts" / "durations.py")
durations = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(durations)

REPORT = """<testsuites><testsuite>
<testcase classname="tests.e2e.test_a" name="one" time="3.0"/>
<testcase classname="tests.e2e.test_a" name="two" time="1.5"/>
<testcase classname="tests.test_b" name="three" time="4.0"><skipped message="no GPU"/></testcase>
</testsuite></testsuites>"""


def test_a_report_is_summed_by_file_and_its_slowest_tests_ranked(tmp_path):
    (tmp_path / "r.xml").write_text(REPORT)
    out = tmp_path / "d.json"
    assert durations.main([str(tmp_path / "r.xml"), "--step", "default", "--wall-s", "5",
                           "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert (data["tests"], data["skipped"], data["summed_test_s"], data["wall_s"]) == (3, 1, 8.5, 5.0)
    assert [f["file"] for f in data["files"]] == ["tests/e2e/test_a.py", "tests/test_b.py"]
    assert [t["test"] for t in data["slowest"]] == ["tests/test_b.py::three", "tests/e2e/test_a.py::one",
                                                    "tests/e2e/test_a.py::two"]


def test_a_missing_report_is_one_line_and_exit_2(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert durations.main([str(tmp_path / "none.xml"), "--step", "default", "--wall-s", "1",
                           "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "none.xml" in err and "--junitxml" in err
    assert not out.exists()


def test_a_report_without_its_step_or_wall_time_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "r.xml").write_text(REPORT)
    out = tmp_path / "d.json"
    assert durations.main([str(tmp_path / "r.xml"), "--wall-s", "5", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--step" in err and "--wall-s" in err
    assert not out.exists()


def test_nothing_to_do_is_one_line_and_exit_2(capsys):
    assert durations.main([]) == 2
    assert "--tiers" in capsys.readouterr().err


def test_the_block_shows_every_tier_and_each_of_cis_steps():
    block = durations.block()
    assert block.startswith(durations.BEGIN) and block.endswith(durations.END)
    for tier, run_by in durations.RUN_BY.items():
        assert f"| {tier} | {run_by} |" in block
    for step, (command, _) in durations.STEPS.items():
        assert f"| {step} | {command} |" in block
