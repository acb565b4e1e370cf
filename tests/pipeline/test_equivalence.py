"""Pipelines compute what one device computes: loss, every gradient, one optimizer step.

Process runtime: one process start per (model, stages), running every case inside.
"""

import copy
import itertools

import pytest
import torch
from torch import nn

from brigade.check.run import CheckConfig, run_check
from brigade.launcher import agent, groups
from brigade.models import load_model
from brigade.models.gpt import GPTConfig
from brigade.pipeline.pipe import LocalPipeline, Pipeline
from brigade.pipeline.stages.partition import split

CASES = list(itertools.product(["gpipe", "1f1b"], [1, 3, 8]))
TINY_GPT = {"gpt_cfg": GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16)}
# For pipelines driven by hand (no ProcessModel, no check): the tied head would be one Parameter
# on two stages, which only ProcessModel and check untie and sum (tests/train, tests/check/test_run.py).
UNTIED_GPT = {"gpt_cfg": GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, tie_embeddings=False)}
MODELS = {  # id -> (model, stages, options)
    "gpt-2": ("gpt", 2, TINY_GPT),
    "gpt-4": ("gpt", 4, TINY_GPT),
    "toy-2": ("toy", 2, {}),
}
_cache: dict = {}


def config(key, runtime):
    model, stages, options = MODELS[key]
    return CheckConfig(model=model, stages=stages, runtime=runtime, batch_size=8,
                       model_options=options)


def process_results(key):
    if key not in _cache:
        _cache[key] = run_check(config(key, "process"), CASES)
    return _cache[key]


def assert_transparent(result):
    assert result["reference"] == "full batch"
    assert result["max_abs_loss_diff"] <= 1e-5
    assert result["max_abs_grad_diff"] <= 1e-5
    assert result["max_abs_param_diff"] <= 1e-5
    assert result["ok"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule,m", CASES)
@pytest.mark.parametrize("key", MODELS)
def test_process_runtime_matches_single_device(key, schedule, m):
    result = process_results(key)[CASES.index((schedule, m))]
    assert (result["schedule"], result["microbatches"]) == (schedule, m)
    assert_transparent(result)


@pytest.mark.parametrize("schedule,m", CASES)
@pytest.mark.parametrize("key", MODELS)
def test_local_runtime_matches_single_device(key, schedule, m):
    (result,) = run_check(config(key, "local"), [(schedule, m)])
    assert_transparent(result)


@pytest.mark.timeout(240)
def test_resnet50_batchnorm_per_microbatch():
    cfg = CheckConfig(model="resnet50", stages=2, batch_size=4, model_options={"image_size": 32})
    full, per_mb = run_check(cfg, [("1f1b", 1), ("gpipe", 2)])
    assert full["reference"] == "full batch" and full["ok"], full
    assert per_mb["reference"] == "micro-batched (BatchNorm)" and per_mb["ok"], per_mb
    cfg.runtime = "local"
    (local,) = run_check(cfg, [("1f1b", 2)])
    assert local["reference"] == "micro-batched (BatchNorm)" and local["ok"], local


def test_check_detects_a_wrong_pipeline(monkeypatch):
    """The comparison can fail: drop one micro-batch's loss weight and it must say so."""
    from brigade.pipeline.batches import microbatch

    monkeypatch.setattr(microbatch, "weights", lambda n, m: [1.0] * m)
    (result,) = run_check(config("toy-2", "local"), [("1f1b", 3)])
    assert not result["ok"] and result["max_abs_loss_diff"] > 1e-3


def _reference(spec, x, y):
    ref = nn.Sequential(*copy.deepcopy(spec.blocks))
    loss = spec.loss_fn(ref(x), y)
    return ref, float(loss)


def shapes_worker():
    """Variable batch and sequence length between steps, then inference, on 2 processes."""
    info = groups.init(threads=1)
    spec = load_model("gpt", seed=0, **TINY_GPT)
    stage = split(spec.blocks, [2, 2])[info.rank]
    pipe = Pipeline(stage, "1f1b", 3, spec.loss_fn)
    out = []
    for n, t in ((7, 16), (5, 9)):
        x, y = (z[:, :t] for z in spec.make_batch(n, torch.Generator().manual_seed(n)))
        ref, ref_loss = _reference(spec, x, y)
        out.append(abs(float(pipe.step(x, y)) - ref_loss))
        for p in stage.parameters():
            p.grad = None
    logits = pipe.forward(x)
    if pipe.is_last:
        out.append((logits - ref(x)).abs().max().item())
    groups.destroy()
    return out


@pytest.mark.timeout(120)
def test_process_runtime_handles_changing_shapes_and_inference():
    results = agent.launch(shapes_worker, 2)
    assert len(results[1]) == 3, "the last stage returns the inference outputs"
    for diffs in results.values():
        assert max(diffs) <= 1e-5


def test_local_runtime_inference_matches():
    spec = load_model("gpt", seed=0, **TINY_GPT)
    x, _ = spec.make_batch(5, torch.Generator().manual_seed(0))
    ref = nn.Sequential(*copy.deepcopy(spec.blocks))
    with LocalPipeline(split(spec.blocks, [1, 2, 1]), ["cpu"] * 3, "gpipe", 2, spec.loss_fn) as pipe:
        assert torch.allclose(pipe.forward(x), ref(x), atol=1e-6)
        assert torch.allclose(pipe.forward(x[:, :5]), ref(x[:, :5]), atol=1e-6)


def test_local_runtime_reports_a_stage_failure():
    blocks = [nn.Linear(4, 4), nn.Linear(3, 2)]  # second block cannot take the first's output
    with LocalPipeline(split(blocks, [1, 1]), ["cpu", "cpu"], "1f1b", 2, nn.functional.mse_loss,
                       timeout_s=30) as pipe:
        with pytest.raises(RuntimeError):
            pipe.step(torch.randn(4, 4), torch.randn(4, 2))


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("key", MODELS)
def test_zero_bubble_matches_single_device_local(key, m):
    cfg = config(key, "local")
    cfg.schedule = "zb"
    (result,) = run_check(cfg, [("zb", m)])
    assert_transparent(result)


@pytest.mark.timeout(120)
def test_zero_bubble_matches_single_device_processes():
    cfg = config("gpt-4", "process")
    for result in run_check(cfg, [("zb", 1), ("zb", 3), ("zb", 8)]):
        assert_transparent(result)


def _max_grad_diff(got, want) -> float:
    got, want = list(got), list(want)
    assert len(got) == len(want) and all(p.grad is not None for p in got + want)
    return max((p.grad - q.grad).abs().max().item() for p, q in zip(got, want))


def zb_data_parallel_worker(bucket_caps: list[float | None]) -> list[dict[str, float]]:
    """dp 2 × two local stages under zb: one accumulating step (sync=False), then one that syncs.

    A cap of None wraps with brigade's `data_parallel` (one bucket here); a small cap forces
    many buckets, so reductions start while the last weight pass still runs.
    """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from brigade.parallel.replicate import data_parallel
    from brigade.pipeline.runtime.reduce import GradientReducer

    started: list[tuple[int, int]] = []  # (buckets already in flight when finish() began, buckets)
    finish = GradientReducer.finish

    def recording_finish(self):
        started.append((len(self._inflight), len(self.buckets)))
        finish(self)

    GradientReducer.finish = recording_finish
    info = groups.init(threads=1)
    batches = [load_model("gpt", seed=0, **UNTIED_GPT).make_batch(8, torch.Generator().manual_seed(s))
               for s in (1, 2)]
    mine = [(x.chunk(2)[info.rank], y.chunk(2)[info.rank]) for x, y in batches]
    out = []
    for cap in bucket_caps:
        spec = load_model("gpt", seed=0, **UNTIED_GPT)
        ref, half = (nn.Sequential(*copy.deepcopy(spec.blocks)) for _ in range(2))
        stage_groups = [dist.new_group([0, 1]) for _ in range(2)]  # one per stage thread

        def wrap(i, module, cap=cap, stage_groups=stage_groups):
            if cap is None:
                return data_parallel(module, stage_groups[i], None)
            return DistributedDataParallel(module, process_group=stage_groups[i], bucket_cap_mb=cap)

        started.clear()
        with LocalPipeline(split(spec.blocks, [2, 2]), ["cpu"] * 2, "zb", 3, spec.loss_fn,
                           wrap=wrap) as pipe:
            pipe.step(*mine[0], loss_scale=0.5, sync=False)
            (spec.loss_fn(half(mine[0][0]), mine[0][1]) * 0.5).backward()  # this replica alone
            accumulating = _max_grad_diff(pipe.parameters(), half.parameters())
            pipe.step(*mine[1], loss_scale=0.5, sync=True)
        for x, y in batches:
            (spec.loss_fn(ref(x), y) * 0.5).backward()
        full_first = nn.Sequential(*copy.deepcopy(spec.blocks))
        spec.loss_fn(full_first(batches[0][0]), batches[0][1]).mul(0.5).backward()
        out.append({"early": sum(e for e, _ in started), "buckets": sum(n for _, n in started),
                    "accumulating": accumulating, "synced": _max_grad_diff(pipe.parameters(),
                    ref.parameters()), "halves_differ": _max_grad_diff(half.parameters(),
                    full_first.parameters())})
    groups.destroy()
    return out


@pytest.mark.timeout(180)
def test_zero_bubble_data_parallel_gradients_match_single_device():
    """After a zb step under dp 2 every gradient is the full batch's, and sync=False keeps it local."""
    results = agent.launch(zb_data_parallel_worker, 2, [None, 0.002])
    for rank, cases in results.items():
        for case in cases:
            assert case["halves_differ"] > 1e-3, "a replica's half must differ from the full batch"
            assert case["accumulating"] <= 1e-5, f"rank {rank}: sync=False must not reduce"
            assert case["synced"] <= 1e-5, f"rank {rank}: {case}"
            # Stage 1 (split backward) reduced once, every bucket started inside its last weight
            # pass; stage 0 runs whole backwards (schedule.whole_first_backward): DDP reduces it.
            assert case["early"] == case["buckets"], case
        assert cases[1]["buckets"] > cases[0]["buckets"] >= 1, cases


def grouped_policy_worker():
    """Each schedule on 2 processes under the NCCL posting policy (forced on gloo), over steps
    whose shapes repeat and change, then inference; losses against the single-device reference."""
    info = groups.init(threads=1)
    spec = load_model("gpt", seed=0, **TINY_GPT)
    stage = split(spec.blocks, [2, 2])[info.rank]
    out = []
    for schedule in ("gpipe", "1f1b", "zb"):
        pipe = Pipeline(stage, schedule, 3, spec.loss_fn)
        transport = pipe.runner.transport
        for n, t in ((7, 16), (7, 16), (5, 9), (5, 9)):  # discovery, predicted, discovery, predicted
            x, y = (z[:, :t] for z in spec.make_batch(n, torch.Generator().manual_seed(n)))
            ref, ref_loss = _reference(spec, x, y)
            diff = abs(float(pipe.step(x, y)) - ref_loss)
            out.append((schedule, transport.policy, transport.mode, diff))
            for p in stage.parameters():
                p.grad = None
        logits = pipe.forward(x)
        diff = (logits - ref(x)).abs().max().item() if pipe.is_last else 0.0
        out.append((schedule, transport.policy, transport.mode, diff))
    groups.destroy()
    return out


@pytest.mark.timeout(240)
def test_grouped_policy_on_gloo_matches_single_device(monkeypatch):
    monkeypatch.delenv("BRIGADE_P2P_POLICY", raising=False)  # grouped: the default, gloo too
    results = agent.launch(grouped_policy_worker, 2)
    modes = ["discovery", "predicted"] * 2 + ["discovery"]  # inference: a new plan
    for rank, cases in results.items():
        for schedule in ("gpipe", "1f1b", "zb"):
            mine = [c for c in cases if c[0] == schedule]
            assert [c[1] for c in mine] == ["grouped"] * 5, (rank, mine)
            assert [c[2] for c in mine] == modes, (rank, mine)
            assert max(c[3] for c in mine) <= 1e-5, (rank, mine)


@pytest.mark.timeout(240)
def test_eager_policy_on_gloo_gradients_match_on_four_stages(monkeypatch):
    """The eager policy, on request: loss, every gradient and the optimizer step, through the
    middle stages."""
    monkeypatch.setenv("BRIGADE_P2P_POLICY", "eager")
    for result in run_check(config("gpt-4", "process"), [("gpipe", 3), ("1f1b", 8), ("zb", 3)]):
        assert_transparent(result)
