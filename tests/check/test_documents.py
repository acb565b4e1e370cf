"""`brigade check --documents`: batches that pack a few documents a row (attention within each,
positions restarting at each), pipelined, split over tensor-parallel processes (sequence
parallel), and over replicas: loss, every gradient and every parameter after one SGD step within
1e-5 of one device on the whole batch (the GPT's own blocks; a Hugging Face family against
transformers' model given the positions and a 4-D mask). That a packed row's loss is its documents'
one by one is tests/models/test_documents.py's; --cp refuses them before any process starts."""

from __future__ import annotations

import pytest
import torch

from brigade.check.run import CheckConfig, run_check
from brigade.errors import BrigadeError
from brigade.models import load_model
from tests.check.test_run import TINY_GPT, _failures
from tests.models.hf.dirs import hf

CASES = [("1f1b", 4, 1), ("interleaved", 4, 2), ("zb", 3, 1)]


def _hf_failures(results: list[dict]) -> list[str]:
    """`_failures` for a Hugging Face family, whose reference is transformers' model."""
    return [str(r) for r in results if not r["ok"] or r["reference"] != "transformers" or
            max(r["max_abs_loss_diff"], r["max_abs_grad_diff"], r["max_abs_param_diff"]) > 1e-5]


def test_the_checked_batch_packs_documents_and_the_micro_batches_carry_them():
    spec = load_model("gpt", documents=True, **TINY_GPT)
    x, _ = spec.make_batch(8, torch.Generator().manual_seed(1))
    assert int(x["documents"].max()) >= 2  # several documents in some row
    from brigade.pipeline.batches.microbatch import split_structure

    parts = split_structure(x, 4)
    assert torch.equal(torch.cat([p["documents"] for p in parts]), x["documents"])


@pytest.mark.timeout(300)
def test_gpt_documents_by_pipeline_2_on_schedules_with_and_without_a_split_backward():
    cfg = CheckConfig(model="gpt", batch_size=8, model_options=TINY_GPT, stages=2, documents=True)
    assert _failures(run_check(cfg, CASES), CASES) == []


@pytest.mark.full
@pytest.mark.timeout(300)
def test_hf_llama_documents_by_pipeline_2_and_tensor_2():
    """4 processes: the mask built per decoder on the whole sequence (sequence parallel gathers
    it for the attention), each process's heads; the rotary at the restarted positions."""
    cfg = CheckConfig(model=hf("llama"), batch_size=8, stages=2, tp=2, documents=True)
    results = run_check(cfg, [("1f1b", 4, 1)])
    assert len(results) == 1 and _hf_failures(results) == []


@pytest.mark.timeout(300)
def test_gpt_documents_under_tensor_2():
    """2 processes: each holds half the heads; the mask, built from the whole sequence that
    sequence parallel gathers for the attention, is the same on both."""
    cases = [("1f1b", 2, 1)]
    cfg = CheckConfig(model="gpt", batch_size=8, model_options=TINY_GPT, documents=True, stages=1, tp=2)
    assert _failures(run_check(cfg, cases), cases) == []


@pytest.mark.full
@pytest.mark.timeout(300)
def test_gpt_documents_under_data_2():
    cases = [("1f1b", 2, 1)]
    for layout in ({"stages": 1, "dp": 2}, {"stages": 2, "dp": 2}):
        cfg = CheckConfig(model="gpt", batch_size=8, model_options=TINY_GPT, documents=True, **layout)
        assert _failures(run_check(cfg, cases), cases) == [], layout


@pytest.mark.full
@pytest.mark.timeout(300)
def test_hf_gpt2_documents_by_pipeline_2():
    """GPT-2's positions (its own embedding, restarted per document) and its mask."""
    cfg = CheckConfig(model=hf("gpt2"), batch_size=8, stages=2, documents=True)
    assert _hf_failures(run_check(cfg, CASES[:1])) == []


def test_documents_are_refused_under_context_parallel_and_on_models_without_them():
    with pytest.raises(BrigadeError, match=r"^--cp 2 with --documents: context parallel takes causal "
                                           r"attention without a mask.*drop --documents, or drop --cp$"):
        run_check(CheckConfig(model="gpt", model_options=TINY_GPT, cp=2, documents=True), CASES[:1])
    with pytest.raises(BrigadeError, match=r"^--documents with toy: only the gpt and hf:DIR models"):
        run_check(CheckConfig(model="toy", documents=True), CASES[:1])
