"""`brigade check` compares against full fp32 arithmetic, whatever the backends default to."""

import pytest
import torch

from brigade.check import CheckConfig, exact_matmuls, run_check
from brigade.cli import main


def test_exact_matmuls_turns_tf32_off_and_restores_it():
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        with exact_matmuls():
            assert not torch.backends.cuda.matmul.allow_tf32
            assert not torch.backends.cudnn.allow_tf32
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = True  # torch's defaults


def test_local_check_runs_under_exact_matmuls(monkeypatch):
    seen = []
    monkeypatch.setattr("brigade.check.run_case",
                        lambda cfg, s, m, rank: seen.append(torch.backends.cudnn.allow_tf32) or _Result())
    run_check(CheckConfig(model="toy", stages=2, runtime="local", batch_size=4, microbatches=2))
    assert seen == [False]


class _Result:
    def to_dict(self):
        return {}


@pytest.mark.parametrize("flags, message", [
    (["--runtime", "local", "--devices", "cpu,cuda:0"], "--devices: cuda:0 is not visible"),
    (["--devices", "cpu,cpu"], "--devices places the stages of --runtime local: add --runtime local"),
    (["--runtime", "local", "--devices", "cpu"], "--devices cpu names 1 devices for 2 stages"),
    (["--runtime", "local", "--devices", "cpu,gpu7"], "--devices: 'gpu7' is not a device"),
])
def test_bad_devices_get_one_line(flags, message, capsys):
    if torch.cuda.device_count() and "cuda:0" in flags[-1]:
        pytest.skip("a GPU is visible: cuda:0 is a valid device here")
    code = main(["check", "--model", "toy", "--stages", "2", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_local_check_on_named_devices(capsys):
    assert main(["check", "--model", "toy", "--stages", "2", "--runtime", "local", "--devices", "cpu,cpu",
                 "--microbatches", "2", "--json"]) == 0
    assert '"ok": true' in capsys.readouterr().out
