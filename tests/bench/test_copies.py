"""bench --compile and tune --compile: every row on compiled copies of the blocks (`bench.copies`),
never a copy of a compiled block; bench.json, tune.json and tune.toml say compile."""

import functools
import json

import pytest
import torch

from brigade.bench.copies import copy_blocks
from brigade.models import load_model
from brigade.parallel.compiled import RECOMPILES, _Compiled
from tests.e2e.helpers import brigade


def test_the_copy_is_compiled_the_original_untouched_and_the_copys_parameters_get_the_gradients(
        monkeypatch):
    real = torch.compile  # dynamo without inductor's code generation: seconds, not a minute
    monkeypatch.setattr(torch, "compile", functools.partial(real, backend="eager"))
    spec = load_model("toy")
    originals = [b.forward for b in spec.blocks]
    copies = copy_blocks(spec.blocks, compile=True)
    assert all(isinstance(c.forward, _Compiled) for c in copies)
    assert all(not isinstance(b.forward, _Compiled) and b.forward == f
               for b, f in zip(spec.blocks, originals))
    # the copy's compiled forward is bound to the copy, not to the block it was copied from
    assert all(c.forward.eager.__self__ is c for c in copies)
    x, y = spec.make_batch(4, torch.Generator().manual_seed(0))
    h = x
    for block in copies:
        h = block(h)
    spec.loss_fn(h, y).backward()
    assert all(p.grad is not None for c in copies for p in c.parameters())
    assert all(p.grad is None for b in spec.blocks for p in b.parameters())
    assert torch._dynamo.config.recompile_limit >= RECOMPILES
    eager = copy_blocks(spec.blocks)
    assert all(not isinstance(c.forward, _Compiled) for c in eager)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_compile_runs_every_row_and_says_so(tmp_path):
    out = tmp_path / "bench"
    result = brigade("bench", "--model", "toy", "--batch-size", "8", "--splits", "4", "--repeats", "2",
                     "--schedules", "1f1b,auto", "--compile", "--out", out, timeout=580)
    assert result.returncode == 0, result.stderr
    assert "brigade bench: toy, compiled," in result.stdout
    data = json.loads((out / "bench.json").read_text())
    assert data["config"]["compile"] is True
    assert {c["name"] for c in data["configs"]} == {
        "single", "model parallel", "brigade", "torch.distributed.pipelining", "ddp"}
    assert all(len(c["rounds_s"]) == 2 and c["median_s"] > 0 for c in data["configs"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tune_compile_writes_a_compiled_train_config(tmp_path):
    out = tmp_path / "tune"
    result = brigade("tune", "--model", "mlp", "--batch-size", "8", "--splits", "4,2",
                     "--schedules", "1f1b,interleaved", "--repeats", "2", "--compile", "--json",
                     "--out", out, timeout=580)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["compile"] is True and data["chosen_mean_s"] > 0
    from brigade.config import load_toml

    assert load_toml(out / "tune.toml")["parallel"]["compile"] is True
