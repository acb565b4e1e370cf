"""The planner's accuracy benchmark: a layout's figures are the medians of its rounds, and bad
flags are one line. (Its whole run, `--tiny`, is the docs' command in tests/e2e/test_readme.py.)"""

import pytest

from brigade.errors import BrigadeError
from brigade.results.plan_accuracy import main, medians


def _round(predicted: float, measured: float, memory: float) -> dict:
    return {"label": "pp 2 1f1b, m 4", "predicted_step_s": predicted, "measured_step_s": measured,
            "step_error": (predicted - measured) / measured, "memory_error": memory}


def test_a_layouts_row_is_the_median_of_its_rounds_and_keeps_each_round():
    row = medians([_round(1.0, 2.0, 0.05), _round(3.0, 1.0, 0.05), _round(2.0, 4.0, 0.05)])
    assert row["predicted_step_s"] == 2.0 and row["measured_step_s"] == 2.0 and row["step_error"] == 0.0
    assert [r["measured_step_s"] for r in row["rounds"]] == [2.0, 1.0, 4.0]
    assert row["memory_error"] == 0.05 and row["label"] == "pp 2 1f1b, m 4"


@pytest.mark.parametrize("flags, message", [(["--rounds", "0"], r"--rounds 0: need at least 1"),
                                            (["--steps", "3"], r"--steps 3: need at least 4")])
def test_bad_flags_are_one_line(flags, message, tmp_path):
    with pytest.raises(BrigadeError, match=message):
        main([*flags, "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())
