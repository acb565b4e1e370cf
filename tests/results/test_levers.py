"""The speed levers' benchmark: a bad flag is one line, nothing written. (Its whole run, --tiny,
is docs/speed.md's command in tests/e2e/test_readme.py, in the slow tier: it compiles.)"""

import pytest

from brigade.errors import BrigadeError
from brigade.results.levers import LEVERS, main


def test_bad_rounds_are_one_line_and_nothing_is_written(tmp_path):
    with pytest.raises(BrigadeError, match=r"--rounds 0: need at least 1"):
        main(["--rounds", "0", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def _fields(flags: list[str]) -> dict:
    import argparse
    import dataclasses

    from brigade import config

    p = argparse.ArgumentParser()
    config.add_flags(p)
    cfg = config.build(p.parse_args(flags), None)
    return {f"{s}.{k}": v for s, section in dataclasses.asdict(cfg).items() for k, v in section.items()}


def test_each_lever_differs_from_its_off_side_in_one_setting_alone():
    for name, off, on in LEVERS:
        a, b = _fields(off), _fields(on)
        assert len([k for k in a if a[k] != b[k]]) == 1, name
