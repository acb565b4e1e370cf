"""`parallel.compiled`: blocks compiled one by one, one graph shared by blocks alike, eager where
a dispatch mode watches, a compiled block's backward not split into I and W; and `brigade check
--compile` under every registered schedule (the slow tier: each world compiles for 20-40 s)."""

import copy
import os

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from brigade.check.run import CheckConfig, run_check
from brigade.models.gpt import GPTConfig, gpt
from brigade.parallel import compiled, recompute
from brigade.pipeline.plans.schedule import SCHEDULES
from brigade.pipeline.runtime.backward import backward_split
from tests.check.test_run import TINY_GPT, _failures

pytestmark = pytest.mark.timeout(300)
CFG = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=32)


class _Watch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_blocks_alike_share_one_graph_and_a_watched_forward_runs_eager_without_spoiling_it():
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    blocks = gpt(CFG)
    eager = copy.deepcopy(blocks)
    modes = recompute.apply(blocks, "none")
    assert compiled.compile_blocks(blocks, list(range(len(blocks))), modes) == []
    x = torch.randint(0, 32, (2, 16))
    with _Watch():  # as the pipeline's first forward is watched for random draws
        h = x
        for b in blocks:
            h = b(h)
    assert not counters["stats"]["unique_graphs"]  # ran eager, and nothing marked never to compile
    h, want = x, x
    for b, e in zip(blocks, eager):
        h, want = b(h), e(want)
    torch.testing.assert_close(h, want, rtol=0, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 3  # embedding, the two blocks alike, head


def test_selective_blocks_stay_eager_and_full_recompute_runs_the_compiled_forward_again():
    torch.manual_seed(0)
    blocks = gpt(CFG)
    eager = copy.deepcopy(blocks)
    blocks[1].recompute, blocks[2].recompute = "full", "selective"  # as a model file may declare
    modes = recompute.apply(blocks, "none")
    assert compiled.compile_blocks(blocks, list(range(len(blocks))), modes) == [2]
    assert isinstance(blocks[1].forward.inner, compiled._Compiled)
    x = torch.randint(0, 32, (2, 16))
    for model in (blocks, eager):
        h = x
        for b in model:
            h = b(h)
        h.square().mean().backward()
    for b, e in zip(blocks, eager):
        for p, q in zip(b.parameters(), e.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-5)


def test_a_compiled_blocks_weight_gradients_come_with_its_input_gradient():
    torch.manual_seed(0)
    block, = gpt(CFG)[1:2]
    twin = copy.deepcopy(block)
    compiled.compile_blocks([block], [0], ["none"])
    x = torch.randn(2, 16, 32)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    dx, weight_step = backward_split(block(xa).square().sum(), None, xa, list(block.parameters()))
    assert all(p.grad is not None for p in block.parameters())  # at I, not W
    done = []
    weight_step(done.extend)
    assert {id(p) for p in done} == {id(p) for p in block.parameters()}
    twin(xb).square().sum().backward()
    torch.testing.assert_close(dx, xb.grad, rtol=0, atol=1e-5)
    for p, q in zip(block.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-5)


def test_a_runs_compiled_code_is_kept_in_its_folder(tmp_path, monkeypatch):
    """...whatever torch has put in TORCHINDUCTOR_CACHE_DIR (its default, once dynamo is imported)."""
    monkeypatch.delenv(compiled.SHARED, raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torchs-default"))
    compiled.use_cache(tmp_path)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compile-cache")


def test_a_shared_cache_folder_takes_every_runs_compiled_code(tmp_path, monkeypatch):
    monkeypatch.setenv(compiled.SHARED, str(tmp_path / "shared"))
    compiled.use_cache(tmp_path / "run")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "shared")


def test_the_suite_compiles_into_torchs_own_cache_folder():
    """tests/conftest.py shares torch's default folder, so `train --compile` in a test finds what
    `check --compile` compiled instead of compiling into a cold OUT/compile-cache."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from tests.conftest import inductor_default_cache

    assert inductor_default_cache() == default_cache_dir() == os.environ[compiled.SHARED]


CASES = [(name, 3, s.virtual or 2) for name, s in SCHEDULES.items()]  # V 2 where a schedule may choose


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("dp,shard", [(1, 1), (2, 2)], ids=["pp2", "shard2xpp2"])
def test_check_compile_equals_one_device_under_every_schedule(dp, shard):
    """Every registered schedule (new ones by construction), compiled blocks against the eager
    one-device reference, fp32, 1e-5; with FSDP2 over the compiled blocks too."""
    cfg = CheckConfig(model="gpt", stages=2, batch_size=16, dp=dp, shard=shard, model_options=TINY_GPT,
                      compile=True)
    assert _failures(run_check(cfg, CASES), CASES) == []


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", ["examples/llama.py:model", "hf:qwen3"])
def test_check_compile_on_a_structured_input_and_a_hugging_face_family(model):
    """examples/llama.py (side inputs, a tied head) and a Hugging Face family (against
    transformers' own model), compiled, under every registered schedule."""
    from tests.models.hf.dirs import hf

    name = hf("qwen3") if model == "hf:qwen3" else model
    results = run_check(CheckConfig(model=name, stages=2, batch_size=8, compile=True), CASES)
    assert _failures([{**r, "reference": "full batch"} for r in results], CASES) == []
