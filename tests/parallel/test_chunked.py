"""The head's loss chunk by chunk (brigade/parallel/chunked.py): the loss and every gradient equal
the plain loss's within 1e-6 (fp32) on the GPT, its head tied and untied, and on a tiny llama
(its side inputs, a StageModule stage), with ignored targets, a chunk of nothing but ignored
targets and a last chunk shorter than the rest; each chunk recomputed in backward; under no_grad
the stage makes logits as before; the auto rule; a chunk of no positions refused in one line.

Under the pipeline and every wrapper (pp, DDP, FSDP2, tp's vocabulary split with and without
sequence parallel), against one device: `brigade check` at the end of this file (a 2-process
world in the default tier, the rest in the full tier)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from brigade.errors import BrigadeError
from brigade.models.gpt import GPTConfig, gpt, gpt_loss
from brigade.parallel import chunked, recompute
from brigade.pipeline.stages.partition import split
from brigade.pipeline.stages.side_inputs import StageModule, split_inputs

T = 16


def _gpt(tie: bool) -> list[nn.Module]:
    torch.manual_seed(0)
    return gpt(GPTConfig(vocab_size=40, block_size=T, n_layer=2, n_head=2, n_embd=16, tie_embeddings=tie))


def _targets(vocab: int, batch: int = 3) -> torch.Tensor:
    y = torch.randint(vocab, (batch, T), generator=torch.Generator().manual_seed(1))
    y[:, :5] = chunked.IGNORE  # the first chunk of 5: nothing but ignored targets
    y[1, 9] = chunked.IGNORE
    return y


def _run(blocks, x, y, loss_fn, chunk: int | None):
    """One forward and backward of the whole model as one stage; chunk None: the plain loss."""
    stage = split(blocks, [len(blocks)])[0]
    c = chunked.install(stage, blocks[-1], chunk, "on") if chunk else None
    if c is not None:
        c.on = True
        loss_fn = c.loss(loss_fn)
    main, side = split_inputs(x, blocks)
    out = stage(main, side) if isinstance(stage, StageModule) else stage(main)
    loss = loss_fn(out, y)
    loss.backward()
    grads = {n: p.grad for n, p in nn.ModuleList(blocks).named_parameters()}
    return loss.detach(), grads, c, out


def _compare(blocks, x, y, loss_fn, chunk: int):
    ref = copy.deepcopy(blocks)
    loss0, grads0, _, _ = _run(ref, x, y, loss_fn, None)
    reruns = recompute.reruns()
    loss1, grads1, c, out = _run(blocks, x, y, loss_fn, chunk)
    assert torch.isfinite(loss1)
    assert abs(loss1 - loss0) <= 1e-6, (loss1, loss0)
    assert grads1.keys() == grads0.keys()
    for name, g in grads0.items():
        torch.testing.assert_close(grads1[name], g, atol=1e-6, rtol=0, msg=name)
    assert type(blocks[-1]).__name__ == type(ref[-1]).__name__  # messages name it as the model does
    n = -(-T // chunk)
    assert c.last == n and recompute.reruns() - reruns == n  # each chunk made again in backward
    assert out.shape[-1] != chunked.vocab(blocks[-1])  # the stage passed the hidden states on


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("chunk", [5, 8])
def test_gpt_chunked_equals_plain(tie, chunk):
    blocks = _gpt(tie)
    x = torch.randint(40, (3, T), generator=torch.Generator().manual_seed(2))
    _compare(blocks, x, _targets(40), gpt_loss, chunk)


def test_llama_chunked_equals_plain():
    """A tiny Hugging Face llama: its head (norm + lm_head, tied) run by the loss in chunks."""
    from brigade.models.hf.model import load_hf
    from tests.models.hf.dirs import tiny_dir

    spec = load_hf(f"hf:{tiny_dir('llama')}", block_size=T)
    x, y = spec.make_batch(2, torch.Generator().manual_seed(0))
    y = y.clone()
    y[:, :5] = chunked.IGNORE
    _compare(spec.blocks, x, y, spec.loss_fn, 5)


def test_under_no_grad_the_stage_makes_logits():
    """Inference and evaluation (no graph): the head runs in the stage; the loss is the plain one."""
    blocks = _gpt(False)
    stage = split(blocks, [len(blocks)])[0]
    c = chunked.install(stage, blocks[-1], 4, "on")
    c.on = True
    loss_fn = c.loss(gpt_loss)
    x, y = torch.randint(40, (2, T)), _targets(40, 2)
    with torch.no_grad():
        out = stage(x)
        assert out.shape == (2, T, 40)
        assert loss_fn(out, y) == gpt_loss(out, y)
    c.on = False  # a pipeline under a split backward: the head in the stage, with a graph too
    assert stage(x).shape == (2, T, 40)


def test_a_head_assembled_again_is_chunked_again():
    """`brigade bench` assembles the same blocks once per case: a second install takes the new
    chunk on the head already made to defer (its class is not derived again: that was a TypeError,
    an inconsistent MRO, which stopped `brigade bench --model gpt`)."""
    blocks = _gpt(False)
    stage = split(blocks, [len(blocks)])[0]
    first = chunked.install(stage, blocks[-1], 4, "on")
    cls = type(blocks[-1])
    again = chunked.install(stage, blocks[-1], 8, "on")
    assert type(blocks[-1]) is cls and blocks[-1]._chunked is again and again is not first
    again.on = True
    loss = again.loss(gpt_loss)(stage(torch.randint(40, (2, T))), _targets(40, 2))
    assert torch.isfinite(loss) and again.last == 2  # 16 positions in chunks of the new 8


def test_the_auto_rule():
    """auto: one chunk (the head once, no recompute) below 64 Mi logits a micro-batch, chunks above;
    on: chunks whenever the sequence spans two; sequence parallel counts the whole sequence."""
    head = _gpt(False)[-1]
    small = chunked.Chunked(copy.deepcopy(head), 1024, "auto")
    assert small.vocab == 40
    assert chunked.helps(1, 4096, 128_256) and not chunked.helps(1, 512, 32_000)
    small.vocab = 128_256
    assert small.chunks(torch.empty(1, 4096, 8, device="meta")) == 4
    assert small.chunks(torch.empty(1, 256, 8, device="meta")) == 1
    forced = chunked.Chunked(copy.deepcopy(head), 100, "on")
    assert forced.chunks(torch.empty(1, 250, 8, device="meta")) == 3
    assert forced.chunks(torch.empty(1, 100, 8, device="meta")) == 1
    parts = chunked.Chunked(copy.deepcopy(head), 256, "auto", parts=4)
    parts.vocab = 32_768
    assert parts.chunks(torch.empty(1, 512, 8, device="meta")) == 2  # 2048 positions whole
    split = chunked.Chunked(copy.deepcopy(head), 1024, "auto", vocab_parts=2)  # V/2 logits each
    assert split.vocab == 20
    split.vocab = 128_256 // 2
    assert split.chunks(torch.empty(1, 1024 * 2, 8, device="meta")) == 2
    assert split.chunks(torch.empty(1, 1024 * 1, 8, device="meta")) == 1  # 64 Mi ÷ 2 logits


def test_targets_of_sequence_parallel_parts():
    """Chunk j of each process's part, gathered in process order: its targets side by side."""
    y = torch.arange(12).view(1, 12)  # 3 parts of 4
    got = chunked._targets(y, 3, 4, 2)
    assert [t.tolist() for t in got] == [[[0, 1, 4, 5, 8, 9]], [[2, 3, 6, 7, 10, 11]]]


def test_off_and_undeclared_heads_are_left_alone():
    blocks = _gpt(True)
    stage = split(blocks, [len(blocks)])[0]
    assert chunked.install(stage, blocks[-1], 8, "off") is None
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
    assert chunked.install(plain, plain[1], 8, "on") is None
    assert type(stage[-1]) is type(_gpt(True)[-1])  # left as it was


def test_a_chunk_of_no_positions_is_one_line():
    head = _gpt(False)[-1]
    with pytest.raises(BrigadeError, match=r"^--loss-chunk 0: must be ≥ 1 positions$"):
        chunked.Chunked(head, 0)


# Under `brigade check`: the chunked loss against one device's plain loss, within 1e-5.
TINY = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=T, tie_embeddings=True)


def _check(cases, **kw) -> list[dict]:
    """`brigade check` of the tiny GPT with its head's loss in chunks of 5 (4 chunks of T = 16)."""
    from brigade.check.run import CheckConfig, run_check

    gpt_cfg = TINY if kw.pop("tie", True) else GPTConfig(**{**TINY.__dict__, "tie_embeddings": False})
    cfg = CheckConfig(**{"model": "gpt", "stages": 2, "batch_size": 8, "model_options": {"gpt_cfg": gpt_cfg},
                         "chunked_loss": "on", "loss_chunk": 5, **kw})
    results = run_check(cfg, cases)
    assert len(results) == len(cases)
    return results


def _split_backward(schedule: str, virtual: int) -> bool:
    from brigade.pipeline.plans.action import W
    from brigade.pipeline.plans.schedule import build

    return any(a.op == W for acts in build(schedule, 2, 3, virtual).values() for a in acts)


def _assert_equal(results, cases, chunks: int = 4) -> None:
    for r, case in zip(results, cases, strict=True):
        schedule, v = case[0], (case[2] if len(case) > 2 else 1)
        assert r["ok"] and r["max_abs_loss_diff"] <= 1e-5 and r["max_abs_grad_diff"] <= 1e-5, r
        # chunked (4 chunks) wherever the backward is whole; the plain head under I and W
        assert r["loss_chunks"] == (0 if _split_backward(schedule, v) else chunks), (case, r)


@pytest.mark.timeout(300)
def test_check_pipeline_of_two_equals_one_device():
    """pp 2 (2 processes): a whole backward chunks; zb's split one leaves the head to the stage."""
    cases = [("1f1b", 3, 1), ("gpipe", 2, 1), ("zb", 3, 1)]
    _assert_equal(_check(cases), cases)


@pytest.mark.full
@pytest.mark.timeout(400)
def test_check_every_schedule_equals_one_device():
    from brigade.pipeline.plans.schedule import SCHEDULES

    cases = [(name, 3, v) for name, s in SCHEDULES.items() for v in ([s.virtual] if s.virtual else [1, 2])]
    _assert_equal(_check(cases), cases)


@pytest.mark.full
@pytest.mark.timeout(400)
@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "no-sp"])
def test_check_tensor_parallel_vocab_split_equals_one_device(sequence_parallel):
    """tp 2 × pp 2: the untied head's vocabulary split, each chunk's logits a DTensor through
    `vocab.split_loss`; under sequence parallel each chunk gathers every process's part."""
    cases = [("1f1b", 3, 1), ("interleaved", 3, 2)]
    results = _check(cases, tie=False, tp=2, sequence_parallel=sequence_parallel)
    _assert_equal(results, cases, chunks=2 if sequence_parallel else 4)  # a part: 8 positions
    assert {r["tp"] for r in results} == {2}


@pytest.mark.full
@pytest.mark.timeout(400)
@pytest.mark.parametrize("stages,dp,shard,reshard,tie", [
    (2, 2, 1, False, True), (2, 2, 2, False, True), (1, 2, 2, False, True), (1, 2, 2, False, False),
    (2, 2, 2, True, True)],
    ids=["ddp-pp2", "fsdp-pp2", "fsdp-one-stage", "fsdp-one-stage-untied", "fsdp-reshard"])
def test_check_data_parallel_equals_one_device(stages, dp, shard, reshard, tie):
    """The head called by the loss as a module: DDP's gradient hooks, FSDP2's gather and
    reduce-scatter (on one stage: the tied head left to the stage's root, the untied one a unit
    of its own, freed after each forward and gathered again for its backward)."""
    cases = [("1f1b", 2, 1)]
    results = _check(cases, stages=stages, dp=dp, shard=shard, reshard=reshard, tie=tie)
    _assert_equal(results, cases)
