"""The speed levers' benchmark: a bad flag is one line, nothing written. (Its whole run, --tiny,
is docs/speed.md's command in tests/e2e/test_readme.py, in the slow tier: it compiles.)"""

import pytest

from brigade.errors import BrigadeError
from brigade.results.levers import LEVERS, main


def test_bad_rounds_are_one_line_and_nothing_is_written(tmp_path):
    with pytest.raises(BrigadeError, match=r"--rounds 0: need at least 1"):
        main(["--rounds", "0", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def test_each_lever_differs_from_its_off_side_by_its_own_flag_alone():
    for name, off, on in LEVERS:
        extra = [f for f in on if f not in off]
        assert extra and all(f in on for f in off), name
