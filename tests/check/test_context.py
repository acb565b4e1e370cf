"""`brigade check --cp`: each sequence split over 2 processes (all-to-all attention on this CPU),
composed with the pipeline under every registered schedule, with sharding, tensor parallel and
recompute, on the GPT, examples/llama.py and a Hugging Face family: loss, every gradient and every
parameter after one SGD step within 1e-5 of one device on the whole sequences.

The schedules come from the registry, so one registered later is covered by construction. One
process start per layout runs all of its cases. The bad inputs (a length or heads that do not
split, ring attention on a CPU) are refused before any process starts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from brigade.check.run import CheckConfig, run_check
from brigade.pipeline.plans.schedule import SCHEDULES
from tests.check.test_run import RECOMPUTE, TINY_GPT, _failures
from tests.models.hf.dirs import hf

# Every schedule of the registry at V 1 and 2 where it takes any, m = 3; and under full recompute
CASES = [(name, 3, v) for name, s in SCHEDULES.items() for v in ([s.virtual] if s.virtual else [1, 2])]
LLAMA = str(Path(__file__).parents[2] / "examples" / "llama.py") + ":model"


def _gpt(**layout) -> CheckConfig:
    return CheckConfig(model="gpt", batch_size=8, model_options=TINY_GPT, cp=2, **layout)


@pytest.mark.timeout(400)
def test_gpt_context_2_by_pipeline_2_on_every_schedule():
    """cp 2 × pp 2 (4 processes): the embedding at its part's global positions, the attention over
    both parts, the tied head on each part's positions; every schedule and V, and each under full
    recompute (the attention's all-to-alls run again in the backward)."""
    cases = CASES + [c for c in RECOMPUTE if c[3] == "full"]
    assert _failures(run_check(_gpt(stages=2), cases), cases) == []


@pytest.mark.timeout(300)
def test_gpt_context_2_with_shard_2_and_with_replicas():
    """dp 2 × cp 2 (4 processes, one stage): FSDP2 over shard 2 × cp 2 = 4, and DDP over dp × cp;
    with selective recompute too."""
    cases = [("1f1b", 2, 1), ("1f1b", 2, 1, "selective")]
    for shard in (2, 1):
        assert _failures(run_check(_gpt(stages=1, dp=2, shard=shard), cases), cases) == []


@pytest.mark.timeout(300)
def test_llama_context_2_by_tensor_2():
    """examples/llama.py under cp 2 × tp 2 (4 processes, one stage): the positions side input cut
    with the tokens, the grouped key/value heads (2, 1 a tp process) repeated for the all-to-all,
    sequence parallel inside each part; sharded over cp (FSDP2: DTensors of tp)."""
    cases = [("1f1b", 2, 1), ("1f1b", 2, 1, "full")]
    cfg = CheckConfig(model=LLAMA, stages=1, batch_size=8, cp=2, tp=2)
    assert _failures(run_check(cfg, cases), cases) == []


@pytest.mark.timeout(400)
def test_hf_llama_context_2_by_pipeline_2_on_every_schedule():
    """A Hugging Face Llama under cp 2 × pp 2, against transformers' own model: the rotary (cos,
    sin) made once over the whole sequence and cut with it; transformers' attention's SDPA call
    routed over the parts."""
    results = run_check(CheckConfig(model=hf("llama"), stages=2, batch_size=8, cp=2), CASES)
    bad = [f"{r['schedule']} V{r['virtual']}: {r['max_abs_loss_diff']:.2e} {r['max_abs_grad_diff']:.2e}"
           for r in results if not r["ok"]]
    assert bad == [] and len(results) == len(CASES)
    assert {r["reference"] for r in results} == {"transformers"} and {r["cp"] for r in results} == {2}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpt_context_2_by_tensor_2_by_pipeline_2_on_every_schedule():
    """cp 2 × tp 2 × pp 2 (8 processes), the GPT at 4 heads (1 a process after both splits)."""
    cfg = _gpt(stages=2, tp=2)
    cfg.model_options = {"gpt_cfg": dataclasses.replace(TINY_GPT["gpt_cfg"], n_head=4)}
    assert _failures(run_check(cfg, CASES), CASES) == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_context_2_with_shard_2_by_pipeline_2_and_more_models():
    """8 processes: dp 2 × cp 2 × pp 2 sharded over shard × cp; llama.py under cp 2 × pp 2 on every
    schedule, and under cp 2 × shard 2; Hugging Face models: a Llama under cp 2 × shard 2, a Qwen3
    (per-head q/k norms) under cp 2 × tp 2 and GPT-2 (learned positions) under cp 2 × dp 2."""
    assert _failures(run_check(_gpt(stages=2, dp=2, shard=2), CASES), CASES) == []
    assert _failures(run_check(CheckConfig(model=LLAMA, stages=2, batch_size=8, cp=2), CASES), CASES) == []
    one = [("1f1b", 2, 1)]
    assert _failures(run_check(CheckConfig(model=LLAMA, stages=1, batch_size=8, cp=2, dp=2, shard=2), one),
                     one) == []
    hf_layouts = ((hf("llama"), {"dp": 2, "shard": 2}), (hf("qwen3"), {"tp": 2}), (hf("gpt2"), {"dp": 2}))
    for model, layout in hf_layouts:
        results = run_check(CheckConfig(model=model, stages=1, batch_size=8, cp=2, **layout))
        assert all(r["ok"] and r["reference"] == "transformers" for r in results), results


HAND = """
import torch
import torch.nn.functional as F
from torch import nn


class Attend(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):  # attention by hand: a softmax over the positions it holds
        q, k, v = self.qkv(x).chunk(3, -1)
        t = x.shape[1]
        scores = (q @ k.transpose(1, 2)).masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
        return x + scores.softmax(-1) @ v


def make():
    return [nn.Embedding(16, 8), Attend(), nn.Linear(8, 16)]


def batch(n, g):
    x = torch.randint(16, (n, 8), generator=g)
    return x, torch.roll(x, -1, 1)


def loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_context_2_compiled():
    """--compile under cp 2: each block's forward compiled with the attention mode inside it (the
    all-to-alls among the compiled code), equal to one device; the check refuses a run in which
    nothing compiled."""
    cases = [("1f1b", 2, 1)]
    assert _failures(run_check(_gpt(stages=1, compile=True), cases), cases) == []


@pytest.mark.timeout(120)
def test_attention_that_does_not_call_sdpa_is_refused_after_the_first_step(tmp_path):
    """A block that attends by hand would see only its own part: nothing routed an attention call
    through the method, and the first step says so in one line (not a wrong loss)."""
    from brigade.errors import RunError

    (tmp_path / "hand.py").write_text(HAND)
    with pytest.raises(RunError, match=r"--cp 2 but no block called F.scaled_dot_product_attention in the "
                                       r"first step: .*call SDPA, or drop --cp$"):
        run_check(CheckConfig(model=f"{tmp_path}/hand.py:make", stages=1, batch_size=4, cp=2))


def _refused(cli, *args: str) -> str:
    done = cli("check", "--stages", "1", *args)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, (done.returncode, err)
    return err[0]


def test_a_sequence_that_cp_does_not_split_is_refused_before_any_process(cli):
    said = _refused(cli, "--model", LLAMA, "--cp", "3")
    assert "examples/llama.py:model's sequence length 32 does not split into --cp 3 = 3 equal parts" in said


def test_heads_that_cp_times_tp_does_not_split_are_refused_before_any_process(cli):
    said = _refused(cli, "--model", LLAMA, "--cp", "2", "--tp", "4")
    assert "has 4 attention heads, which --cp 2 × --tp 4 = 8 does not divide" in said


def test_ring_attention_on_a_cpu_is_refused_naming_the_method_that_works(cli):
    said = _refused(cli, "--cp", "2", "--cp-method", "ring")
    assert said.endswith("--cp-method ring on cpu: torch's ring attention runs on CUDA only (its CPU "
                         "attention kernel has no sharding strategy); use --cp-method all-to-all")


def test_a_model_without_sequences_is_refused(cli):
    said = _refused(cli, "--model", "resnet50", "--cp", "2")
    assert "--cp 2 on resnet50, whose inputs hold no token sequence" in said
