"""`brigade check --float8`: a float8 pipeline against the same float8 model on one device, cut
into the same micro-batches (each micro-batch's scales its own): 1e-5 as fp32, under every
registered schedule (the slow tier), sharded too; under tensor parallel each process scales its
own part of a matmul, so there float8's own tolerance holds (stated: 2e-2)."""

import pytest

from brigade.check.run import CheckConfig, run_check
from brigade.models.gpt import GPTConfig
from brigade.pipeline.plans.schedule import SCHEDULES
from tests.check.test_run import _failures

pytestmark = pytest.mark.timeout(400)
pytest.importorskip("torchao")  # the float8 extra, which scripts/setup.sh installs
GPT = {"gpt_cfg": GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, tie_embeddings=True)}
CASES = [(name, 3, s.virtual or 2) for name, s in SCHEDULES.items()]  # V 2 where a schedule may choose


def _check(cases, **layout) -> list[dict]:
    cfg = CheckConfig(model="gpt", stages=2, batch_size=16, model_options=GPT, float8="tensorwise", **layout)
    return run_check(cfg, cases)


def test_a_float8_pipeline_equals_float8_on_one_device_micro_batch_by_micro_batch():
    (result,) = _check([("1f1b", 4, 1)], runtime="local")
    assert result["ok"] and result["reference"] == "micro-batched (float8)", result
    assert result["max_abs_grad_diff"] <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("dp,shard", [(1, 1), (2, 2)], ids=["pp2", "shard2xpp2"])
def test_float8_under_every_schedule(dp, shard):
    results = _check(CASES, dp=dp, shard=shard)
    bad = [f for f in _failures([{**r, "reference": "full batch"} for r in results], CASES)]
    assert bad == [] and {r["reference"] for r in results} == {"micro-batched (float8)"}


@pytest.mark.slow
def test_float8_under_tensor_parallel_within_its_own_tolerance():
    (result,) = _check([("1f1b", 3, 1)], tp=2, atol=2e-2)
    assert result["ok"], result  # exact here; the CLI's larger GPT differed by 0.008


@pytest.mark.slow
@pytest.mark.parametrize("model", ["examples/llama.py:model", "hf:qwen3"])
def test_float8_on_a_structured_input_and_a_hugging_face_family(model):
    from tests.models.hf.dirs import hf

    name = hf("qwen3") if model == "hf:qwen3" else model
    cfg = CheckConfig(model=name, stages=2, batch_size=8, float8="tensorwise")
    assert _failures([{**r, "reference": "full batch"} for r in run_check(cfg, CASES)], CASES) == []
