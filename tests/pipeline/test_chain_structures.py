"""A structure may appear anywhere in the chain of blocks, not only in the batch.

The model (a file, as a user writes one, with no batch() or loss(): both are inferred):

    (B, 6) ─Split─► {"h": (B, 8), "skip": (B, 8)} ─Pair─► (h', skip) ─Join─► (B, 3) ─Out─► (B, 3)

Its batch is one tensor, so deciding "plain or structured" from the batch alone refused it
(`block 0 (Split) returned dict; each block must return one tensor`). Cut into 2 × V pieces, a
dict, a tuple and a tensor each cross a boundary, and the skip's gradient flows back across
two. Every registered schedule (`schedule.names()`, so later ones are covered too) under both
runtimes of `brigade check`, `brigade train` and the Python API must equal one device within
1e-5; `brigade bench` and `brigade tune`, whose probes and torch's pipelining take one tensor
per stage, refuse it in one line before any worker starts. The process runtime starts its 2
gloo processes once for every schedule.
"""

import itertools
import json
import multiprocessing as mp
import subprocess
import sys

import pytest
import torch
from torch import nn

from brigade import LocalPipeline
from brigade.check.inputs import sample
from brigade.check.run import CheckConfig, run_check
from brigade.errors import BrigadeError
from brigade.models import load_model
from brigade.pipeline.plans.schedule import SCHEDULES, names
from brigade.pipeline.stages.partition import check_chain, choose_balance, split, time_costs

TOL = 1e-5
MODEL = '''
import torch
from torch import nn


class Split(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 8)

    def forward(self, x):  # (B, 6) -> {"h": (B, 8), "skip": (B, 8)}
        h = self.lin(x)
        return {"h": torch.tanh(h), "skip": 2 * h}


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):  # dict -> (h, skip): the skip passes through
        return torch.tanh(self.lin(x["h"])), x["skip"]


class Join(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x):  # (h, skip) -> (B, 3): the skip from block 0 joins here
        h, skip = x
        return self.lin(h * skip)


class Out(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):  # (B, 3) -> (B, 3)
        return self.lin(torch.relu(x))


def model():
    return [Split(), Pair(), Join(), Out()]
'''
# Every schedule at its own V, and at V = 1 too where it takes any V; m = 3 of a batch of 8.
CASES = [(name, 3, v) for name in names()
         for v in dict.fromkeys([SCHEDULES[name].resolve_virtual(0)] + ([1] if SCHEDULES[name].virtual is None
                                                                        else []))]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> str:
    f = tmp_path_factory.mktemp("chain-model") / "chain.py"
    f.write_text(MODEL)
    return f"{f}:model"


def _blocks(model_file: str) -> list[nn.Module]:
    return load_model(model_file).blocks


def test_check_chain_probes_every_block_output(model_file):
    specs = check_chain(_blocks(model_file), torch.randn(2, 6))
    assert [s.kind for s in specs] == ["dict", "tuple", "T", "T"]
    assert specs[0].keys == ("h", "skip") and specs[1].n_tensors == 2


class Unsendable(nn.Module):
    def forward(self, x):
        return x, object()


@pytest.mark.parametrize("late,message", [
    (lambda b: b[3], r"^block 0 \(Split\) outputs dict\(h: Tensor\(2, 8\) float32, skip: Tensor\(2, 8\) "
                     r"float32\), which block 1 \(Out\) cannot take: TypeError: "),
    (lambda b: b[2], r"^block 0 \(Split\) outputs dict\(.*\), which block 1 \(Join\) cannot take: "),
    (lambda b: Unsendable(), r"^block 1 \(Unsendable\)'s output\[1\] is a builtins.object, which cannot "
                             r"be sent"),
])
def test_a_block_that_cannot_take_a_structure_is_named(model_file, late, message):
    blocks = _blocks(model_file)
    with pytest.raises(BrigadeError, match=message) as err:
        check_chain([blocks[0], late(blocks)], torch.randn(2, 6))
    assert "\n" not in str(err.value)


def test_balance_by_time_measures_a_structured_chain(model_file):
    blocks = _blocks(model_file)
    costs = time_costs(blocks, torch.randn(4, 6), repeats=1)
    assert len(costs) == 4 and all(c > 0 for c in costs)
    assert all(p.grad is None for b in blocks for p in b.parameters())  # nothing left behind
    balance = choose_balance(blocks, 2, by="time", sample=sample(torch.randn(8, 6)))
    assert sum(balance) == 4 and len(balance) == 2


class Masked(nn.Module):
    side_inputs = ("mask",)

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x, *, mask):  # (B, 6), (B, 1) -> (B, 6)
        return self.lin(x) * mask


def test_balance_by_time_hands_blocks_their_side_inputs():
    """A batch of {"x", "mask"}: the time profile runs on its sample, the mask by keyword."""
    blocks = [nn.Linear(6, 6), Masked(), nn.Linear(6, 2)]
    batch = {"x": torch.randn(8, 6), "mask": torch.ones(8, 1)}
    assert len(time_costs(blocks, sample(batch), repeats=1)) == 3
    assert sum(choose_balance(blocks, 2, by="time", sample=sample(batch))) == 3
    with pytest.raises(BrigadeError, match=r"block 1 \(Masked\) declares side input 'mask' but the batch "
                                           r"has only \['x'\]"):
        time_costs(blocks, {"x": torch.randn(2, 6)})


def test_a_structured_batch_gives_a_two_row_sample():
    x = {"ids": torch.arange(14).view(7, 2), "mask": torch.ones(7)}
    got = sample(x)
    assert got["ids"].tolist() == [[0, 1], [2, 3]] and got["mask"].shape == (2,)


def _failures(results: list[dict], cases) -> list[str]:
    bad = []
    for r, (schedule, m, v) in zip(results, cases, strict=True):
        cuts = list(itertools.accumulate(r["balance"]))[:-1]
        if (r["schedule"], r["microbatches"], r["virtual"]) != (schedule, m, v) or not r["ok"] or \
                max(r["max_abs_loss_diff"], r["max_abs_grad_diff"], r["max_abs_param_diff"]) > TOL or \
                not {1, 2} & set(cuts):  # a dict (after block 0) or a tuple (after 1) crosses
            bad.append(f"{schedule} V={v} m={m}: {r}")
    return bad


@pytest.mark.timeout(300)
@pytest.mark.parametrize("runtime", ["local", "process"])
def test_check_every_schedule_equals_one_device(model_file, runtime):
    results = run_check(CheckConfig(model=model_file, stages=2, runtime=runtime, batch_size=8), CASES)
    assert len(results) == len(CASES) >= len(names())
    assert _failures(results, CASES) == []


@pytest.mark.timeout(300)
def test_sharded_and_recomputed_structures_equal_one_device(model_file):
    """shard 2 × pp 2 (4 processes): the dict, the tuple and the skip's gradient cross sharded stages,
    recomputed fully and selectively."""
    cases = [("1f1b", 2, 1, "full"), ("zb", 2, 1, "selective"), ("zbv", 2, 2, "full")]
    results = run_check(CheckConfig(model=model_file, stages=2, runtime="process", batch_size=8, dp=2,
                                    shard=2), cases)
    assert _failures(results, [c[:3] for c in cases]) == []
    assert [(r["shard"], r["recompute"]) for r in results] == [(2, c[3]) for c in cases]


def test_brigade_check_command_takes_the_model(cli, model_file):
    got = cli("check", "--model", model_file, "--stages", "2", "--runtime", "local", "--schedule", "zbv",
              "--microbatches", "3", "--balance-by", "time")
    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith("OK: ") and "zbv, V=2" in got.stdout


BATCHNORM_MODEL = '''
import torch
from torch import nn


class Take(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x):  # {"x": (B, 6)} -> (B, 4)
        return self.lin(x["x"])


def model():
    return [Take(), nn.BatchNorm1d(4), nn.Linear(4, 2)]


def batch(n, g):
    return {"x": torch.randn(n, 6, generator=g)}, torch.randn(n, 2, generator=g)
'''


def test_a_structured_batch_with_batchnorm_runs_the_micro_batched_reference(tmp_path):
    """BatchNorm makes the reference run micro-batch after micro-batch, weighted by their sizes:
    the batch size comes from the structure, not from a tensor's shape."""
    f = tmp_path / "bn.py"
    f.write_text(BATCHNORM_MODEL)
    (r,) = run_check(CheckConfig(model=f"{f}:model", stages=2, runtime="local", batch_size=7,
                                 microbatches=3))
    assert r["ok"] and r["reference"] == "micro-batched (BatchNorm)", r


def test_the_python_api_local_pipeline_forward_and_step(model_file):
    """brigade.LocalPipeline on the blocks cut by hand: the loss and the inference output equal
    one device's (inference merges the last stage's micro-batch outputs)."""
    spec = load_model(model_file)
    x, y = spec.make_batch(8, torch.Generator().manual_seed(1))
    ref = nn.Sequential(*load_model(model_file).blocks)
    with torch.no_grad():
        want_out = ref(x)
    want_loss = float(spec.loss_fn(want_out, y))
    stages = split(spec.blocks, [1, 1, 1, 1])
    with LocalPipeline(stages, ["cpu", "cpu"], "dualpipev", 4, spec.loss_fn) as pipe:
        assert abs(float(pipe.step(x, y)) - want_loss) <= TOL
        torch.testing.assert_close(pipe.forward(x), want_out, atol=TOL, rtol=0)


@pytest.mark.parametrize("command", ["bench", "tune"])
def test_bench_and_tune_refuse_it_in_one_line(cli, model_file, command):
    got = cli(command, "--model", model_file)
    assert got.returncode == 2 and got.stdout == ""
    assert got.stderr.count("\n") == 1, got.stderr
    assert f"{model_file}: block 0 (Split) returns a dict: brigade {command} times models whose " \
           "blocks pass one tensor" in got.stderr


def test_the_last_block_returning_a_structure_needs_batch_and_loss(tmp_path):
    f = tmp_path / "tail.py"
    f.write_text(MODEL + "\n\ndef tail():\n    return [Split(), Pair()]\n")
    spec = load_model(f"{f}:tail")
    with pytest.raises(BrigadeError, match=r"^block 1 \(Pair\) returns a structure: define batch\(\) and "
                                           r"loss\(\) in the model file"):
        spec.make_batch(2, torch.Generator())


def _api_losses(config_toml: str, out: str) -> dict[str, list[float]]:
    """In a fresh process: brigade.Trainer on the run's own configuration, on one device and as
    2 local stages (dualpipev); per-step losses."""
    from dataclasses import replace

    from brigade import ParallelConfig, Trainer
    from brigade.config.sources import build as build_config
    from brigade.config.sources import load_toml
    from brigade.launcher import groups
    from brigade.train.data import build

    cfg = build_config(toml=load_toml(config_toml))
    groups.init(threads=1)
    runs = {"one device": ParallelConfig(nproc=1),
            "local stages": ParallelConfig(nproc=1, local_stages=2, schedule="dualpipev", microbatches=2)}
    got = {}
    for name, parallel in runs.items():
        blocks, loss_fn, train, *_ = build(cfg)
        trainer = Trainer(blocks, loss_fn, train, None, parallel=parallel, optim=cfg.optim,
                          train=replace(cfg.train, out=f"{out}/{len(got)}"), metrics=False)
        got[name] = [r["loss"] for r in trainer.fit() if "loss" in r]
        trainer.close()
    groups.destroy()
    return got


@pytest.mark.timeout(240)
def test_brigade_train_and_the_trainer_equal_one_device(model_file, tmp_path):
    """`brigade train` over 2 processes (pp = 2, zbv: the dict, the tuple and the tensor each
    cross between the processes), and brigade.Trainer in one process, lose what one device does."""
    out = tmp_path / "run"
    run = subprocess.run([sys.executable, "-m", "brigade", "train", "--model", model_file, "--nproc", "2",
                          "--pp", "2", "--schedule", "zbv", "--microbatches", "2", "--max-steps", "3",
                          "--batch-size", "8", "--warmup-steps", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=200)
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    cli_losses = [r["loss"] for r in rows if "loss" in r]
    with mp.get_context("spawn").Pool(1) as pool:  # its own process group, not this process's
        api = pool.apply(_api_losses, (str(out / "config.toml"), str(tmp_path / "api")))
    assert len(cli_losses) == 3 and cli_losses[0] != cli_losses[-1]  # it trained
    assert api["one device"] == pytest.approx(cli_losses, abs=TOL)
    assert api["local stages"] == pytest.approx(cli_losses, abs=TOL)
