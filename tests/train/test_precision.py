"""Mixed precision: the loss in fp32 under bf16/fp16 (CPU autocast), fp16's loss scaling, and bf16
under sharding as FSDP2's mixed precision (bf16 gathered weights and activations, fp32 shards)."""

import argparse

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from brigade import config as bconfig
from brigade.config import OptimConfig, ParallelConfig, TrainConfig
from brigade.config.precision import autocast_dtype
from brigade.data.chars import load_text_data
from brigade.errors import BrigadeError
from brigade.launcher import agent, groups
from brigade.models.gpt import GPTConfig, gpt, gpt_loss
from brigade.pipeline.batches import microbatch
from brigade.pipeline.pipe import LocalPipeline
from brigade.train.precision import LossScaler
from brigade.train.trainer import Trainer


def _stages():
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(16, 64), nn.GELU()), nn.Linear(64, 97)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_loss_and_its_sum_are_fp32_under_autocast(dtype):
    """The pipeline's loss is the fp32 loss of the very outputs autocast produced."""
    stages = _stages()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 16, generator=g), torch.randint(97, (24,), generator=g)
    m = 3
    with LocalPipeline(stages, ["cpu", "cpu"], "1f1b", m, F.cross_entropy, autocast=dtype) as pipe:
        got = pipe.step(x, y)
        assert pipe.last_results[-1].loss.dtype == torch.float32
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        outs = [stages[1](stages[0](xs)) for xs in microbatch.split(x, m)]
    assert outs[0].dtype == dtype  # autocast did run
    ws, ys = microbatch.weights(24, m), microbatch.split(y, m)
    want = sum(F.cross_entropy(o.float(), t) * w for o, t, w in zip(outs, ys, ws))
    half = sum(F.cross_entropy(o, t) * w for o, t, w in zip(outs, ys, ws))  # the old computation
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert abs(float(half) - float(want)) > 1e-4  # so this test fails on a half-precision loss


def test_an_unsupported_autocast_dtype_is_refused_in_one_line():
    with pytest.raises(BrigadeError, match=r"^autocast torch.float64: expected None \(fp32\), "
                                           r"torch.bfloat16 or torch.float16$"):
        LocalPipeline(_stages(), ["cpu", "cpu"], "1f1b", 2, F.cross_entropy, autocast=torch.float64)


@pytest.mark.parametrize("precision,bf16,device,want", [
    ("", True, "cuda", torch.bfloat16), ("", True, "cpu", None), ("", False, "cuda", None),
    ("bf16", False, "cpu", torch.bfloat16), ("fp16", True, "cuda", torch.float16),
    ("fp16", False, "cpu", torch.float16), ("fp32", True, "cuda", None),
])
def test_precision_follows_bf16_unless_given(precision, bf16, device, want):
    assert autocast_dtype(precision, bf16, device) is want


def test_an_unknown_precision_is_refused_by_the_config():
    parser = argparse.ArgumentParser()
    bconfig.add_flags(parser)
    with pytest.raises(BrigadeError, match=r"^--precision 'fp8': expected bf16, fp16 or fp32 "
                                           r"\(or leave it empty to follow --bf16\)$"):
        bconfig.build(parser.parse_args(["--precision", "fp8"]))


def test_loss_scaler_backs_off_grows_and_gives_up():
    s = LossScaler(scale=8.0, growth_interval=2, min_scale=2.0)
    assert s.skip(float("inf")) and s.scale == 4.0
    assert not s.skip(1.0) and s.scale == 4.0
    assert not s.skip(1.0) and s.scale == 8.0  # two good steps in a row
    assert s.skip(float("nan")) and s.scale == 4.0 and s.good_steps == 0
    assert s.skip(float("inf")) and s.scale == 2.0
    assert not s.skip(float("inf")) and s.scale == 2.0  # at the floor: the non-finite check reports it


STEPS = 6


def fp16_run(pp: int = 1, scale: float = 2.0 ** 19, shard: int = 1) -> dict:
    """fp16 steps of a tiny GPT from a loss scale that overflows (here up to 2**18); records, and
    whether the parameters stayed as they were after the first (skipped) step."""
    vocab, train, _ = load_text_data("", 32, 0.1)
    torch.manual_seed(0)
    # Untied: the scales that overflow were found for this model; whether 2**18 overflows is a
    # matter of the last bits, and a tied head moves them (the tie's own tests are in tests/train).
    blocks = gpt(GPTConfig(len(vocab), 32, n_layer=2, n_head=2, n_embd=32, dropout=0.0,
                           tie_embeddings=False))
    info = groups.init(threads=1)
    par = ParallelConfig(nproc=info.world_size, pp=pp, dp=info.world_size // pp, microbatches=2, shard=shard)
    trainer = Trainer(blocks, gpt_loss, train, None, parallel=par, optim=OptimConfig(warmup_steps=2),
                      train=TrainConfig(max_steps=STEPS, batch_size=8, precision="fp16"), metrics=False)
    trainer.scaler.scale = scale
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    first = trainer.train_step()
    unchanged = all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())
    history = [first] + [trainer.train_step() for _ in range(STEPS - 1)]
    trainer.close()
    groups.destroy()
    return {"history": history, "unchanged_after_skip": unchanged}


@pytest.mark.timeout(120)
def test_fp16_skips_an_overflowing_step_then_trains():
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        run = pool.apply(fp16_run)
    h = run["history"]
    assert h[0]["skipped"] and run["unchanged_after_skip"]
    assert [(r["skipped"], r["loss_scale"]) for r in h] == \
        [(True, 2.0 ** 19), (True, 2.0 ** 18)] + [(False, 2.0 ** 17)] * (STEPS - 2)
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in h[2:])
    assert h[-1]["loss"] < h[2]["loss"]  # the steps taken train


@pytest.mark.timeout(240)
@pytest.mark.parametrize("pp,shard", [(2, 1), (1, 2)], ids=["pp2", "shard2"])
def test_fp16_stages_and_shards_skip_the_same_steps_and_keep_the_same_scale(pp, shard):
    """pp 2: stage 0 sees no loss, yet skips exactly where the last stage does, at the same scale,
    as one device. shard 2: an overflow in one shard's gradients skips the step on both, as under
    DDP's dp 2 (each replica's half batch overflows otherwise than one device's whole one)."""
    import multiprocessing as mp

    if shard == 1:
        with mp.get_context("spawn").Pool(1) as pool:
            alone = pool.apply(fp16_run)["history"]
    else:
        alone = agent.launch(fp16_run, 2, 1)[0]["history"]
    runs = agent.launch(fp16_run, 2, pp, 2.0 ** 19, shard)
    for rank, run in runs.items():
        h = run["history"]
        assert run["unchanged_after_skip"], f"rank {rank}"
        assert [(r["skipped"], r["loss_scale"]) for r in h] == \
            [(r["skipped"], r["loss_scale"]) for r in alone], f"rank {rank}"
        assert [r["loss"] for r in h] == pytest.approx([r["loss"] for r in alone], abs=2e-3)


def fp16_resumed(out: str, stop_at: int | None) -> dict:
    """TINY fp16 for STEPS steps from a loss scale that overflows twice, grown every 2 good steps,
    so the scale at step 3 (2**17, one good step) is not a fresh scaler's (2**16, none). With
    `stop_at`: snapshot there, then a new trainer resumes from it as `brigade train` does."""
    from brigade.snapshot import collective, writer
    from brigade.snapshot.compat import run_facts
    from brigade.train.data import build
    from brigade.train.run import resume
    from tests.e2e.helpers import TINY

    parser = argparse.ArgumentParser()
    bconfig.add_flags(parser)
    cfg = bconfig.build(parser.parse_args([*TINY, "--precision", "fp16", "--nproc", "1", "--out", out,
                                           "--max-steps", str(STEPS)]))
    groups.init(threads=1)

    def trainer(scale: float | None) -> Trainer:
        blocks, loss_fn, train, _, vocab, *_ = build(cfg)
        t = Trainer(blocks, loss_fn, train, None, parallel=cfg.parallel, optim=cfg.optim, train=cfg.train,
                    metrics=False)
        t.scaler.growth_interval, t.vocab = 2, vocab
        if scale is not None:
            t.scaler.scale = scale
        return t

    tr = trainer(2.0 ** 19)
    history = [tr.train_step() for _ in range(stop_at or STEPS)]
    if stop_at:
        facts = run_facts(cfg, tr.sampler.cursor, tr.sampler.epoch, tr.vocab.chars)
        writer.save(out, stop_at, tr.model, tr.optimizer, facts, loss_scaler=tr.scaler)
        tr.close()
        tr = trainer(None)
        assert resume(tr, cfg) == stop_at
        history += [tr.train_step() for _ in range(STEPS - stop_at)]
    digest = collective.model_params_sha256(tr.model)
    tr.close()
    groups.destroy()
    return {"params_sha256": digest, "scales": [(r["skipped"], r["loss_scale"]) for r in history]}


@pytest.mark.timeout(240)
def test_fp16_resume_restores_the_loss_scale_bit_for_bit(tmp_path):
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        whole = pool.apply(fp16_resumed, (str(tmp_path / "whole"), None))
        resumed = pool.apply(fp16_resumed, (str(tmp_path / "resumed"), 3))
    # 2**19 and 2**18 overflow; after two good steps at 2**17 the scale grows to 2**18: a resume
    # that restarted the scaler would take step 4 at 2**16 and grow later
    assert whole["scales"][:4] == [(True, 2.0 ** 19), (True, 2.0 ** 18), (False, 2.0 ** 17),
                                   (False, 2.0 ** 17)]
    assert resumed == whole


def sharded_bf16_run(shard: int, precision: str) -> dict:
    """4 steps of a tiny GPT over 2 processes (shard 2: FSDP2; shard 1: DDP): losses, rank 0's
    memory by kind on step 2, and the dtypes its blocks' weights had during a forward."""
    vocab, train, _ = load_text_data("", 32, 0.1)
    torch.manual_seed(0)
    blocks = gpt(GPTConfig(len(vocab), 32, n_layer=2, n_head=2, n_embd=32, dropout=0.0))
    info = groups.init(threads=1)
    par = ParallelConfig(nproc=info.world_size, dp=info.world_size, shard=shard)
    trainer = Trainer(blocks, gpt_loss, train, None, parallel=par, optim=OptimConfig(warmup_steps=2),
                      train=TrainConfig(max_steps=4, batch_size=8, precision=precision), metrics=False)
    seen = set()
    blocks[1].register_forward_pre_hook(lambda m, args: seen.add(str(next(m.parameters()).dtype)))
    history = trainer.fit()
    kept = {str(p.dtype) for p in trainer.model.parameters()}
    memory = trainer.memory_report[0]
    trainer.close()
    groups.destroy()
    return {"losses": [r["loss"] for r in history if "loss" in r and "step" in r], "memory": memory,
            "computed": sorted(seen), "kept": sorted(kept)}


@pytest.mark.timeout(240)
def test_bf16_under_sharding_computes_in_bf16_over_fp32_shards_and_trains_as_autocast_does():
    """FSDP2's mixed precision: the blocks compute with bf16 weights and the shards stay fp32; the
    losses follow DDP's bf16 autocast, and the activations take about half of fp32's bytes."""
    mixed = agent.launch(sharded_bf16_run, 2, 2, "bf16")[0]
    fp32 = agent.launch(sharded_bf16_run, 2, 2, "fp32")[0]
    autocast = agent.launch(sharded_bf16_run, 2, 1, "bf16")[0]
    assert mixed["computed"] == ["torch.bfloat16"] and mixed["kept"] == ["torch.float32"], mixed
    assert autocast["computed"] == ["torch.float32"] and fp32["computed"] == ["torch.float32"]
    assert mixed["losses"] == pytest.approx(autocast["losses"], abs=2e-3)
    assert mixed["losses"] != autocast["losses"]  # not the same computation
    assert mixed["memory"]["activations"] < 0.6 * fp32["memory"]["activations"], (mixed, fp32)
    assert mixed["memory"]["params"] == fp32["memory"]["params"]  # fp32 shards: 4 bytes a parameter
