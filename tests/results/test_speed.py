"""brigade.results.speed refuses what it cannot time, in one line, before starting any process."""

import pytest

from brigade.results import speed


@pytest.mark.parametrize("schedule, message", [
    ("zbv", "--schedule zbv: this bench times one stage per rank (gpipe, 1f1b, zb); for several, run "
            "`brigade bench --model mlp --batch-size 256 --splits 128 --schedules zbv`"),
    ("nope", "--schedule nope: unknown; expected one of gpipe, 1f1b, zb"),
])
def test_a_schedule_it_cannot_time_is_one_line(capsys, tmp_path, schedule, message):
    with pytest.raises(SystemExit) as exit_:
        speed.main(["--schedule", schedule, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
