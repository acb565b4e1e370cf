"""`brigade check`: fp32 comparisons, and the transparency grid of issue #14.

Grid: for the GPT (its head tied to the embedding: one parameter on two stages) and a user
model file, every schedule × V (the registry's fixed V, or 1 and 2) × m ∈ {1, 3, 8}, and each
of those at m = 3 under full and selective recompute, × dp ∈ {1, 2} (dp 2 replicated, DDP, or
sharded, FSDP2) on 2 pipeline ranks: loss, every gradient and every parameter after one SGD step
within 1e-5 of one device on the whole batch. One process start per (model, dp, shard) runs all
of its cases.
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from brigade.check import run as check_run
from brigade.check.run import CheckConfig, exact_matmuls, run_check
from brigade.cli import main
from brigade.config.recompute import MODES
from brigade.errors import RunError
from brigade.models.gpt import GPTConfig
from brigade.pipeline.plans.schedule import SCHEDULES

GRID = [(name, m, v) for name, s in SCHEDULES.items() for v in ([s.virtual] if s.virtual else [1, 2])
        for m in (1, 3, 8)]
# and each recompute mode (the registry's: one added later is checked too) over every schedule
# and V (at m = 3), in the same worlds
RECOMPUTE = [(name, m, v, mode) for name, m, v in GRID if m == 3 for mode in MODES if mode != "none"]
TINY_GPT = {"gpt_cfg": GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, tie_embeddings=True)}
USER_MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn


def make():
    def block(n_in, n_out):
        return nn.Sequential(nn.Linear(n_in, n_out), nn.GELU())
    return nn.Sequential(block(6, 16), block(16, 16), block(16, 16), block(16, 16), nn.Linear(16, 3))


def batch(n, g):
    return torch.randn(n, 6, generator=g), torch.randint(3, (n,), generator=g)


def loss(out, y):
    return F.cross_entropy(out, y)
'''
_grid: dict = {}


@pytest.fixture(scope="module")
def user_model(tmp_path_factory) -> str:
    f = tmp_path_factory.mktemp("user-model") / "blocks.py"
    f.write_text(USER_MODEL)
    return f"{f}:make"


def grid_config(model: str, dp: int, runtime: str = "process", shard: int = 1,
                stages: int = 2) -> CheckConfig:
    options = TINY_GPT if model == "gpt" else {}
    return CheckConfig(model=model, stages=stages, runtime=runtime, batch_size=16, dp=dp, shard=shard,
                       model_options=options)


def _failures(results: list[dict], cases) -> list[str]:
    bad = []
    for r, case in zip(results, cases, strict=True):
        schedule, m, v, mode = (*case, "none")[:4]
        row = (r["schedule"], r["microbatches"], r["virtual"], r["recompute"])
        if row != (schedule, m, v, mode) or not r["ok"] or r["reference"] != "full batch" or \
                max(r["max_abs_loss_diff"], r["max_abs_grad_diff"], r["max_abs_param_diff"]) > 1e-5:
            bad.append(f"{schedule} V={v} m={m}: {r}")
    return bad


@pytest.mark.timeout(400)
@pytest.mark.parametrize("dp,shard", [(1, 1), (2, 1), (2, 2)], ids=["dp1", "dp2", "shard2"])
@pytest.mark.parametrize("model", ["gpt", "user"])
def test_transparency_grid(model, dp, shard, user_model):
    """dp 2 replicates each stage (DDP) or, with shard 2, shards it over both replicas (FSDP2);
    every case without recompute, and every schedule under full and selective recompute."""
    name = user_model if model == "user" else "gpt"
    results = run_check(grid_config(name, dp, shard=shard), GRID + RECOMPUTE)
    assert len(results) == len(GRID + RECOMPUTE)
    assert {(r["dp"], r["shard"]) for r in results} == {(dp, shard)}
    assert _failures(results, GRID + RECOMPUTE) == []
    worst = {k: max(r[k] for r in results) for k in ("max_abs_loss_diff", "max_abs_grad_diff",
                                                     "max_abs_param_diff")}
    print(f"{model} dp={dp} shard={shard}: {len(results)} cases, worst {worst}")


@pytest.mark.timeout(300)
def test_resharding_after_each_forward_equals_one_device():
    """--reshard: parameters freed after each forward (and after each whole backward), gathered
    again for the next; under I/W kept from the input pass to the step's end."""
    cases = [(name, 3, v) for name, m, v in GRID if m == 3]
    cfg = grid_config("gpt", 2, shard=2)
    cfg.reshard = True
    assert _failures(run_check(cfg, cases), cases) == []


@pytest.mark.timeout(300)
def test_hsdp_two_replicas_of_two_shards_on_every_schedule():
    """HSDP 2 × 2 on 4 processes (one stage): the shard groups reduce-scatter, the replicas
    all-reduce what they hold; the tied GPT still equals one device."""
    cases = [(name, 2, 1) for name, s in SCHEDULES.items() if not s.virtual]
    results = run_check(grid_config("gpt", 4, shard=2, stages=1), cases)
    assert _failures(results, cases) == [] and {(r["dp"], r["shard"]) for r in results} == {(4, 2)}


def _fsdp_on_its_own(monkeypatch, reshard_after_backward: bool) -> None:
    """ShardedReducer's hold undone: FSDP reduce-scatters after every backward, the input pass's
    too, and (as FSDP's default) reshards after it, or keeps the gathered weights (as the reducer
    keeps them); the reduction at the step's end, which the weight passes' gradients need, gone."""
    from brigade.pipeline.runtime import reduce

    def own_way(self):
        self.module.set_requires_gradient_sync(True)
        self.module.set_is_last_backward(True)
        self.module.set_reshard_after_backward(reshard_after_backward)

    monkeypatch.setattr(reduce.ShardedReducer, "_hold", own_way)
    monkeypatch.setattr(reduce.ShardedReducer, "finish", lambda self: None)


def test_check_fails_when_fsdp_reduces_on_its_own_under_a_split_backward(monkeypatch):
    """Left to itself FSDP reduce-scatters when a unit's input gradient is done, which under zb's
    split backward is before its weight pass (the trap torch's own PP + zero-bubble met): the
    check must see the weight gradients that never got reduced (none reached the shards: an
    infinite difference, and weights that SGD never moved)."""
    _fsdp_on_its_own(monkeypatch, reshard_after_backward=False)
    (result,) = run_check(grid_config("gpt", 2, shard=2), [("zb", 2, 1)])
    assert not result["ok"] and result["max_abs_grad_diff"] == float("inf")
    assert result["max_abs_param_diff"] > 1e-4 and result["max_abs_loss_diff"] < 1e-5


def test_check_fails_when_fsdp_also_reshards_after_the_input_pass(monkeypatch):
    """With FSDP's default, resharding after each backward, the input pass frees the gathered
    weights that the weight pass's saved graph still reads (torch 2.13: "its data is not allocated
    yet"): the check fails as a worker's error, never passes."""
    _fsdp_on_its_own(monkeypatch, reshard_after_backward=True)
    with pytest.raises(RunError, match=r"worker rank \d failed: .*allocat"):
        run_check(grid_config("gpt", 2, shard=2), [("zb", 2, 1)])


@pytest.mark.timeout(300)
def test_local_runtime_with_data_parallel(user_model):
    """dp processes, each driving a LocalPipeline; device i of each process DDPs with device i."""
    cases = [("interleaved", 3, 2), ("zb", 8, 1), ("zbv", 1, 2)]
    results = run_check(grid_config(user_model, 2, runtime="local"), cases)
    assert _failures(results, cases) == []
    assert {(r["runtime"], r["dp"]) for r in results} == {("local", 2)}


def test_local_runtime_several_stages_per_device():
    cases = [(s, m, v) for s, m, v in GRID if v == 2 and m == 3]
    results = run_check(grid_config("gpt", 1, runtime="local"), cases)
    assert _failures(results, cases) == [] and len(results) == len(cases) >= 4  # every V = 2 schedule


def test_check_fails_when_a_replica_runs_the_wrong_slice(monkeypatch, user_model):
    """The grid can fail: a replica that runs another slice than its own must not pass."""

    monkeypatch.setattr(check_run, "_replica", lambda t, world: t[: t.shape[0] // 2])
    (result,) = run_check(grid_config(user_model, 1, runtime="local"), [("1f1b", 2, 1)])
    assert not result["ok"] and result["max_abs_loss_diff"] > 1e-4


def test_check_fails_when_tied_copies_are_not_summed(monkeypatch):
    """The tied GPT's embedding and head copies must each hold the sum of both gradients."""

    from brigade.pipeline.stages.ties import StageTies

    monkeypatch.setattr(StageTies, "sum_grads", lambda self, held: None)
    (result,) = run_check(grid_config("gpt", 1, runtime="local"), [("1f1b", 1, 1)])
    assert not result["ok"] and result["max_abs_grad_diff"] > 1e-4


LLAMA = str(Path(__file__).parents[2] / "examples" / "llama.py") + ":model"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("runtime", ["local", "process"])
@pytest.mark.parametrize("stages", [2, 4])
def test_llama_side_inputs_and_tied_head(stages, runtime):
    """examples/llama.py (padding-mask side input, head tied to the embedding) on every schedule;
    on 4 stages only V = 1 fits its 6 blocks. One process start per (stages, runtime)."""
    cases = [(name, 4, v) for name, s in SCHEDULES.items() for v in ([s.virtual] if s.virtual else [1, 2])
             if stages * v <= 6]
    results = run_check(CheckConfig(model=LLAMA, stages=stages, runtime=runtime, batch_size=8), cases)
    assert _failures(results, cases) == []
    assert len(results) == len(cases) and (stages == 4) != any(v == 2 for *_, v in cases)


@pytest.mark.timeout(300)
def test_llama_sharded_with_selective_recompute():
    """examples/llama.py under shard 2 × pp 2 (4 processes): a side input and a tied head, sharded and
    recomputed, on a schedule of each placement (one per rank, loop, V)."""
    cases = [("zb", 2, 1, "selective"), ("interleaved", 2, 2, "full"), ("dualpipev", 2, 2, "selective")]
    cfg = CheckConfig(model=LLAMA, stages=2, runtime="process", batch_size=8, dp=2, shard=2)
    assert _failures(run_check(cfg, cases), cases) == []


# Tensor parallel: every schedule and V of the registry at m = 3, and each under full recompute.
TP_GRID = [case for case in GRID if case[1] == 3] + [c for c in RECOMPUTE if c[3] == "full"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("model", ["gpt", pytest.param("llama", marks=pytest.mark.slow)])  # llama: 40 s
def test_tensor_parallel_2_by_pipeline_2_on_every_schedule(model):
    """tp 2 × pp 2 (4 processes): each stage's blocks split over 2 processes (attention by heads,
    the llama's grouped key/value heads too); the GPT's head untied, its vocabulary split and
    the loss taking split logits (`parallel.vocab`), the llama's tied embedding and head whole on
    both; loss, every gradient gathered from its DTensor shards and every parameter after a step
    equal one device, on every registered schedule and V, with and without recompute."""
    cfg = grid_config("gpt", 1) if model == "gpt" else CheckConfig(model=LLAMA, stages=2, batch_size=8)
    if model == "gpt":  # (the tied head under tp: the 8-process test below, and no sequence parallel)
        cfg.model_options = {"gpt_cfg": dataclasses.replace(TINY_GPT["gpt_cfg"], tie_embeddings=False)}
    cfg.tp = 2
    cases = TP_GRID if model == "gpt" else [c for c in TP_GRID if 2 * c[2] <= 6]
    results = run_check(cfg, cases)
    assert _failures(results, cases) == []
    assert {(r["tp"], r["sequence_parallel"]) for r in results} == {(2, True)}


@pytest.mark.timeout(300)
def test_tensor_parallel_without_sequence_parallel():
    """tp 2 × pp 2 with --no-sequence-parallel: the norms and the residual stream whole on both tp
    processes again (the plans' sequence entries left out), a whole and a split backward, V 2."""
    cases = [("1f1b", 3, 1), ("zbv", 3, 2, "full")]
    cfg = grid_config("gpt", 1)
    cfg.tp, cfg.sequence_parallel = 2, False
    results = run_check(cfg, cases)
    assert _failures(results, cases) == [] and {r["sequence_parallel"] for r in results} == {False}


@pytest.mark.timeout(400)
def test_tensor_parallel_with_sharding_and_pipeline_on_8_processes():
    """tp 2 × shard 2 × pp 2 (8 processes on this machine's 2 cores: slow, not wrong): FSDP2 over
    the shard dimension of the same mesh makes each planned parameter a 2-D DTensor; every
    registered schedule and V."""
    cases = [(name, 2, v) for name, s in SCHEDULES.items() for v in ([s.virtual] if s.virtual else [1, 2])]
    cfg = grid_config("gpt", 2, shard=2)
    cfg.tp = 2
    results = run_check(cfg, cases)
    assert _failures(results, cases) == [] and {(r["tp"], r["shard"]) for r in results} == {(2, 2)}


@pytest.mark.timeout(300)
def test_tensor_parallel_with_replicas_and_no_pipeline():
    """dp 2 × tp 2, one stage (4 processes): the replicas go through FSDP2 at shard 1 (DDP takes no
    DTensor parameters); a whole and a split backward."""
    cases = [("1f1b", 2, 1), ("zb", 2, 1)]
    cfg = grid_config("gpt", 2, stages=1)
    cfg.tp = 2
    assert _failures(run_check(cfg, cases), cases) == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shard,ep", [(1, 1), (2, 1), (1, 2), (2, 2)],
                         ids=["replicated", "sharded", "replicated-ep2", "sharded-ep2"])
def test_a_mixture_of_experts_equals_one_device_on_every_schedule(shard, ep):
    """The GPT with a mixture of experts in every block (4 experts, top 2, its load-balancing
    loss on): dp 2 × pp 2 (DDP, or FSDP2 sharding the stacked experts), with the experts split
    over both replicas (--ep 2: tokens sent to them by all-to-all) or whole on each, every
    registered schedule and V, one of them under full recompute: the balancing loss, taken per
    sequence and weighted by each forward's share of the step, sums across micro-batches and
    replicas to one device's on the whole batch, and the experts' gradients, summed over every
    process whose tokens reached them, to one device's."""
    cases = [(name, 2, v) for name, s in SCHEDULES.items() for v in ([s.virtual] if s.virtual else [1])]
    cases.append(("zb", 2, 1, "full"))
    cfg = dataclasses.replace(grid_config("gpt", 2, shard=shard), ep=ep)
    cfg.model_options = {"gpt_cfg": dataclasses.replace(TINY_GPT["gpt_cfg"], experts=4, top_k=2)}
    assert _failures(run_check(cfg, cases), cases) == []


@pytest.mark.timeout(300)
def test_a_mixture_of_experts_under_tensor_parallel_equals_one_device_on_every_schedule():
    """tp 2 × pp 2: the mixture whole on both tp processes, on the whole sequence gathered from
    sequence parallel's parts, its output cut back to each process's part."""
    cases = [(name, 2, v) for name, s in SCHEDULES.items() for v in ([s.virtual] if s.virtual else [1])]
    cfg = dataclasses.replace(grid_config("gpt", 1), tp=2)
    cfg.model_options = {"gpt_cfg": dataclasses.replace(TINY_GPT["gpt_cfg"], experts=4, top_k=2)}
    assert _failures(run_check(cfg, cases), cases) == []


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_compiled_experts_split_over_ep_equal_one_device():
    """--compile with the experts over ep 2 of dp 2 × pp 2: the all-to-alls break the graphs,
    the balancing loss still reaches the router (`moe._AddAux`), every schedule's split backward
    takes a compiled block's I and W together."""
    cases = [("1f1b", 2, 1), ("zb", 2, 1)]
    cfg = dataclasses.replace(grid_config("gpt", 2), ep=2, compile=True)
    cfg.model_options = {"gpt_cfg": dataclasses.replace(TINY_GPT["gpt_cfg"], experts=4, top_k=2)}
    assert _failures(run_check(cfg, cases), cases) == []


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_every_axis_with_experts_split_equals_one_device():
    """dp 2 × pp 2 × tp 2 (8 processes), --ep 2 --shard 2: the experts split over both replicas,
    FSDP2 over dp × tp, tensor parallel and sequence parallel around the whole mixture."""
    cases = [("1f1b", 2, 1), ("zbv", 2, 2)]
    cfg = dataclasses.replace(grid_config("gpt", 2, shard=2), ep=2, tp=2)
    cfg.model_options = {"gpt_cfg": dataclasses.replace(TINY_GPT["gpt_cfg"], experts=4, top_k=2)}
    assert _failures(run_check(cfg, cases), cases) == []


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_experts_split_over_part_of_the_replicas_equal_one_device():
    """dp 4 × pp 2 (8 processes), --ep 2 --shard 2: two expert groups, each expert's weights
    sharded over the two processes holding it (edp 2) and its gradients summed over them."""
    cases = [("1f1b", 2, 1), ("zbv", 2, 2), ("dualpipev", 2, 2, "full")]
    cfg = dataclasses.replace(grid_config("gpt", 4, shard=2), ep=2)
    cfg.model_options = {"gpt_cfg": dataclasses.replace(TINY_GPT["gpt_cfg"], experts=4, top_k=2)}
    assert _failures(run_check(cfg, cases), cases) == []


@pytest.mark.parametrize("flags, message", [
    (["--schedule", "1f1b", "--virtual", "2"], "--virtual 2: schedule 1f1b runs exactly 1 stage(s) per rank"),
    (["--schedule", "zbv", "--virtual", "3"], "--virtual 3: schedule zbv runs exactly 2"),
    (["--dp", "0"], "--dp 0: must be ≥ 1"),
    (["--dp", "-1"], "--dp -1: must be ≥ 1"),
    (["--dp", "64"], "--dp 64 × --stages 2 = 128 workers but this machine should run at most"),
    (["--dp", "64", "--runtime", "local"], "--dp 64 × --stages 2 = 128 workers"),
    (["--stages", "1", "--dp", "3"], "--batch-size 8 does not split into --dp 3 equal replica batches"),
    (["--dp", "2", "--microbatches", "5"], "microbatches=5 is more than a replica's batch (4 = --batch-size"),
    (["--dp", "2", "--runtime", "local", "--devices", "cpu,cpu"], "--devices with --dp 2"),
    (["--model", "resnet50", "--dp", "2", "--microbatches", "2"], "resnet50 has BatchNorm"),
    (["--model", "toy", "--schedule", "zbv"], "stages=4 but the model has only 3 blocks"),
    (["--tp", "2"], "block 0 (Linear) of toy has no tensor-parallel plan, so --tp 2 cannot split it"),
    (["--model", "gpt", "--tp", "3"], "block 1 (Block) of gpt: attn.qkv splits into 4 heads (or groups), "
                                      "which --tp 3 does not divide: use a --tp that divides 4"),
    (["--model", "gpt", "--tp", "2", "--runtime", "local"], "--tp 2 with --runtime local"),
    (["--model", "gpt", "--tp", "0"], "--tp 0: must be ≥ 1"),
    (["--model", "gpt", "--tp", "2", "--dp", "4"], "--dp 4 × --stages 2 × --tp 2 = 16 workers"),
])
def test_bad_virtual_and_dp_get_one_line(cli, flags, message):
    base = [] if "--model" in flags else ["--model", "toy"]
    out = cli("check", *base, *flags)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.timeout(300)
def test_cli_interleaved_virtual_2_dp_2(capsys):
    code = main(["check", "--model", "toy", "--stages", "1", "--schedule", "interleaved", "--virtual", "2",
                 "--dp", "2", "--microbatches", "2", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["ok"], data
    assert (data["virtual"], data["dp"], data["stages"], len(data["balance"])) == (2, 2, 1, 2)


def test_exact_matmuls_turns_tf32_off_keeps_cudnn_deterministic_and_restores_it():
    cudnn = torch.backends.cudnn
    torch.backends.cuda.matmul.allow_tf32 = cudnn.allow_tf32 = cudnn.benchmark = True
    try:
        with exact_matmuls():
            assert not torch.backends.cuda.matmul.allow_tf32
            assert not cudnn.allow_tf32 and cudnn.deterministic and not cudnn.benchmark
        assert torch.backends.cuda.matmul.allow_tf32 and cudnn.allow_tf32 and cudnn.benchmark
        assert not cudnn.deterministic
    finally:
        torch.backends.cuda.matmul.allow_tf32 = cudnn.benchmark = False
        cudnn.allow_tf32 = True  # torch's defaults


@pytest.mark.parametrize("devices, want", [
    (["cpu", "cpu"], "cpu"),
    (["cuda:0", "cuda:0"], "cuda:0"),  # one GPU: the reference runs the stages' kernels
    (["cpu", "cuda:0"], "cpu"),        # mixed: the CPU, and the GPU's rounding shows in the diffs
    (["cuda:0", "cuda:1"], "cpu"),
])
def test_the_reference_runs_on_the_stages_device_when_they_share_one(devices, want):
    from brigade.check.run import _reference_device
    from brigade.world.degrees import Degrees
    from brigade.world.mesh import World

    local = World(Degrees(), torch.device(devices[0]), devices)  # the local runtime: a device per rank
    assert _reference_device(local) == torch.device(want)
    on_rank = World(Degrees(), torch.device("cuda", 1))  # process runtime: the rank's GPU
    assert _reference_device(on_rank) == torch.device("cuda", 1)


def test_local_check_runs_under_exact_matmuls(monkeypatch):
    seen = []
    monkeypatch.setattr("brigade.check.run.run_case", lambda cfg, case, world=None:
                        seen.append(torch.backends.cudnn.allow_tf32) or _Result())
    run_check(CheckConfig(model="toy", stages=2, runtime="local", batch_size=4, microbatches=2))
    assert seen == [False]


class _Result:
    def to_dict(self):
        return {}


@pytest.mark.parametrize("flags, message", [
    (["--runtime", "local", "--devices", "cpu,cuda:0"], "--devices: cuda:0 is not visible"),
    (["--devices", "cpu,cpu"], "--devices places the stages of --runtime local: add --runtime local"),
    (["--runtime", "local", "--devices", "cpu"], "--devices cpu names 1 devices for 2 stages"),
    (["--runtime", "local", "--devices", "cpu,gpu7"], "--devices: 'gpu7' is not a device"),
])
def test_bad_devices_get_one_line(flags, message, capsys):
    if torch.cuda.device_count() and "cuda:0" in flags[-1]:
        pytest.skip("a GPU is visible: cuda:0 is a valid device here")
    code = main(["check", "--model", "toy", "--stages", "2", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_local_check_on_named_devices(capsys):
    assert main(["check", "--model", "toy", "--stages", "2", "--runtime", "local", "--devices", "cpu,cpu",
                 "--microbatches", "2", "--json"]) == 0
    assert '"ok": true' in capsys.readouterr().out


@pytest.mark.parametrize("devices, hint", [("cpu,cuda:0", True), ("cuda:0,cuda:0", False)])
def test_a_mismatch_across_a_cpu_and_a_gpu_names_their_rounding(cli, monkeypatch, devices, hint):
    """Seen on an H200: ResNet-50 with stages on cpu and cuda:0 differs from the CPU reference
    by 3e-4 (fp32 on a GPU rounds otherwise); the verdict says so rather than blame the pipeline."""
    import brigade.check.run

    result = {"ok": False, "virtual": 1, "balance": [15, 3], "reference": "full batch",
              "reference_device": "cpu", "max_abs_loss_diff": 0.0, "max_abs_grad_diff": 3e-4,
              "max_abs_param_diff": 3e-5}
    monkeypatch.setattr(brigade.check.run, "run_check", lambda cfg, port=None: [result])
    out = cli("check", "--model", "resnet50", "--runtime", "local", "--devices", devices)
    assert out.returncode == 1 and "MISMATCH" in out.stdout
    assert ("rounds differently" in out.stdout) == hint
