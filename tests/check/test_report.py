"""What `brigade check` prints (brigade/check/report.py), from a result alone."""

from brigade.check.config import CheckConfig
from brigade.check.report import lines

RESULT = {"ok": False, "virtual": 2, "balance": [2, 1, 1, 2], "reference": "full batch",
          "reference_device": "cpu", "max_abs_loss_diff": 2e-4, "max_abs_grad_diff": 3e-8,
          "max_abs_param_diff": 4e-9}


def test_the_verdict_the_layout_and_the_differences():
    cfg = CheckConfig(stages=2, schedule="zbv", dp=2, shard=2, recompute="full")
    first, second = lines(cfg, RESULT)
    assert first == ("MISMATCH: gpt on 2 stages (process), zbv, V=2, dp=2 (shard 2), recompute full, m=4, "
                     "balance [2, 1, 1, 2], reference: full batch on cpu")
    assert second == ("  max |Δloss| 0.0002   max |Δgrad| 3e-08   max |Δparam| after one SGD step 4e-09   "
                      "(tolerance 1e-05)")


def test_a_failure_across_device_kinds_says_why_it_may_not_be_the_pipeline():
    cfg = CheckConfig(runtime="local", devices=["cpu", "cuda:0"])
    assert "a CPU and a GPU, whose fp32 arithmetic rounds differently" in lines(cfg, RESULT)[-1]
    assert len(lines(cfg, {**RESULT, "ok": True})) == 2


def test_tensor_parallel_says_whether_the_sequence_was_split():
    cfg = CheckConfig(stages=2, schedule="1f1b", tp=2)
    assert ", tp=2 (sequence parallel), m=4" in lines(cfg, {**RESULT, "sequence_parallel": True})[0]
    assert ", tp=2, m=4" in lines(cfg, {**RESULT, "sequence_parallel": False})[0]
