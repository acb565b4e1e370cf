"""`brigade check` compares against full fp32 arithmetic, whatever the backends default to."""

import torch

from brigade.check import CheckConfig, exact_matmuls, run_check


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
