"""`brigade check --model hf:DIR`: every registered schedule, under pp 2 and dp 2 × pp 2 (and
tensor parallel, and the other families, in the slow tier), against the unmodified
transformers model: the loss, every gradient and every parameter after an SGD step within 1e-5.

The schedules come from the registry, so one registered later is covered by construction. The
reference is transformers' own model, loaded from the directory: the blocks are compared with
what they were cut from, not with themselves."""

from __future__ import annotations

import pytest
import torch

from brigade.check.run import CheckConfig, run_check
from brigade.pipeline.plans.schedule import SCHEDULES
from tests.models.hf.dirs import hf

pytestmark = pytest.mark.timeout(300)
# Every schedule, at V 2 where it takes one: 6 blocks cut into 2 stages × V pieces.
CASES = [(name, 4, v) for name, s in SCHEDULES.items() for v in ([s.virtual] if s.virtual else [1, 2])]


def _check(model: str, **layout) -> list[dict]:
    results = run_check(CheckConfig(model=model, batch_size=8, **layout), CASES)
    bad = [f"{r['schedule']} V{r['virtual']}: {r['max_abs_loss_diff']:.2e} {r['max_abs_grad_diff']:.2e}"
           for r in results if not r["ok"]]
    assert bad == [] and len(results) == len(CASES)
    assert {r["reference"] for r in results} == {"transformers"}
    return results


def test_every_schedule_equals_transformers():
    _check(hf("llama"), stages=2, dp=2)  # dp 2 × pp 2: the default tier's; pp 2 alone below


@pytest.mark.slow
@pytest.mark.parametrize("family,dp", [("llama", 1), ("gpt2", 2), ("gpt2", 1), ("qwen2", 1), ("mistral", 2),
                                       ("qwen3", 1)])
def test_every_schedule_equals_transformers_in_every_family(family, dp):
    _check(hf(family, tie=family != "qwen2"), stages=2, dp=dp)


@pytest.mark.slow
@pytest.mark.parametrize("family,tie", [("llama", True), ("qwen3", True), ("qwen2", False),
                                        ("qwen3_moe", True)])
def test_tensor_parallel_2_by_pipeline_2_equals_transformers(family, tie):
    """qwen3: its q and k norms are "per-head"; qwen2 untied: its head splits the vocabulary;
    qwen3_moe: its mixtures run whole on both tp processes."""
    results = _check(hf(family, tie=tie), stages=2, tp=2)
    assert {(r["tp"], r["sequence_parallel"]) for r in results} == {(2, True)}


@pytest.mark.parametrize("shard", [1, 2], ids=["replicated", "sharded"])
def test_a_mixture_with_its_experts_split_over_ep_equals_transformers(shard):
    """Qwen3-MoE, dp 2 × pp 2 with --ep 2 (each process 2 of the 4 experts, tokens by all-to-all),
    with DDP or with FSDP2 sharding the dense weights over both replicas: every schedule."""
    results = _check(hf("qwen3_moe"), stages=2, dp=2, ep=2, shard=shard)
    assert {r["ep"] for r in results} == {2}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_the_other_mixtures_equal_transformers_with_ep(family):
    _check(hf(family), stages=2, dp=2, ep=2)


def test_a_wrong_cut_fails_the_check(monkeypatch):
    """The comparison can fail: a decoder that skips its layer's mask (attends to the future)."""
    from brigade.models.hf import blocks

    monkeypatch.setattr(blocks, "layer_mask", lambda padding, window, length, device, documents=None:
                        torch.ones(1, 1, length, length, dtype=torch.bool, device=device))
    result = run_check(CheckConfig(model=hf("llama"), stages=2, runtime="local", batch_size=4))[0]
    assert not result["ok"] and result["max_abs_loss_diff"] > 1e-3
