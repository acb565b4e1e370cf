"""`brigade check --lora`: adapters on the attention and MLP projections, the rest frozen, on both
sides (their B drawn, so both adapters have gradients); loss, every adapter's gradient and every
tensor after one SGD step within 1e-5 of one device, under each axis and every registered schedule
(so one registered later is covered by construction). One process start per layout."""

from __future__ import annotations

import dataclasses

import pytest

from brigade.check.run import CheckConfig, run_check
from brigade.cli import main
from brigade.pipeline.plans.schedule import SCHEDULES
from tests.check.test_run import RECOMPUTE, TINY_GPT, _failures

CASES = [(name, 3, v) for name, s in SCHEDULES.items() for v in ([s.virtual] if s.virtual else [1, 2])]
UNTIED = {"gpt_cfg": dataclasses.replace(TINY_GPT["gpt_cfg"], tie_embeddings=False)}


def _gpt(**layout) -> CheckConfig:
    return CheckConfig(model="gpt", batch_size=8, model_options=TINY_GPT, lora=4, **layout)


def _lora_rows(results: list[dict]) -> None:
    assert {r["lora"] for r in results} == {4}


@pytest.mark.timeout(300)
def test_lora_on_two_pipeline_ranks_on_every_schedule():
    """pp 2 (2 processes): the embedding's stage has no adapter (nothing of it trains) and the
    pipeline still sends its gradients back; every schedule and V of the registry."""
    results = run_check(_gpt(stages=2), CASES)
    assert _failures(results, CASES) == []
    _lora_rows(results)


@pytest.mark.full
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", [{"dp": 2, "shard": 2}, {"dp": 2}], ids=["shard2", "ddp2"])
def test_lora_with_replicas_by_pipeline_2_on_every_schedule(layout):
    """dp 2 × pp 2 (4 processes), sharded (FSDP2: frozen weights sharded, no gradient reduced for
    them) or replicated (DDP leaves them out); every schedule and V, and each under full recompute."""
    cases = CASES + [c for c in RECOMPUTE if c[3] == "full"]
    results = run_check(_gpt(stages=2, **layout), cases)
    assert _failures(results, cases) == []
    _lora_rows(results)


@pytest.mark.full
@pytest.mark.timeout(400)
def test_lora_under_tensor_and_sequence_parallel_by_pipeline_2_on_every_schedule():
    """tp 2 × pp 2 (4 processes), sequence parallel: each colwise layer's B split as its weight, A
    whole; each rowwise layer's A split, its partial output summed with the layer's own; every
    schedule and V, the head untied (its vocabulary split)."""
    cfg = _gpt(stages=2, tp=2)
    cfg.model_options = UNTIED
    results = run_check(cfg, CASES)
    assert _failures(results, CASES) == []
    assert {(r["tp"], r["sequence_parallel"]) for r in results} == {(2, True)}


@pytest.mark.full
@pytest.mark.timeout(400)
def test_lora_under_context_parallel_by_pipeline_2():
    """cp 2 × pp 2 (4 processes): each sequence split, the adapters on each part's positions."""
    cases = [("1f1b", 3, 1), ("zbv", 3, 2)]
    assert _failures(run_check(_gpt(stages=2, cp=2), cases), cases) == []


def test_cli_check_refuses_a_negative_rank_in_one_line(capsys):
    assert main(["check", "--lora", "-2"]) == 2
    assert capsys.readouterr().err == ("brigade check: error: --lora -2: the adapters' rank must be ≥ 1; "
                                       "0 checks without LoRA\n")


def test_the_report_names_the_rank():
    from brigade.check.report import lines

    row = {"ok": True, "virtual": 1, "balance": [3, 3], "reference": "full batch", "reference_device": "cpu",
           "max_abs_loss_diff": 0.0, "max_abs_grad_diff": 0.0, "max_abs_param_diff": 0.0}
    assert ", LoRA rank 4," in lines(_gpt(stages=2), row)[0]


@pytest.mark.full
@pytest.mark.timeout(400)
def test_lora_on_compiled_blocks_equals_one_device():
    """--compile: each block's forward compiled with the adapters' hooks inside it, under zb's
    split backward (a compiled block's weight gradients come with its input's) on 2 ranks."""
    cases = [("zb", 3, 1)]
    cfg = _gpt(stages=2)
    cfg.compile = True
    assert _failures(run_check(cfg, cases), cases) == []
