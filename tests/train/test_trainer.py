"""The trainer is transparent: every layout gives the same per-step losses as one device.

The GPT here ties its embedding and head (the default): split over stages, each stage holding
one keeps a copy, and after 20 steps the copies are still bit for bit equal.
"""


import pytest
import torch
import torch.distributed as dist

from brigade.config import OptimConfig, ParallelConfig, TrainConfig
from brigade.data.chars import load_text_data
from brigade.launcher import agent, groups
from brigade.models.gpt import GPTConfig, gpt, gpt_loss
from brigade.train.trainer import Trainer

STEPS = 20
# How close a layout's per-step losses and gradient norms come to one device's: fp32 to within
# its rounding, bf16 to fp32's within bf16's (brigade.results.regenerate reads both for the table).
FP32_ABS = 1e-5
BF16_ABS = 0.05


def losses(pp: int = 1, local_stages: int = 1, grad_accum: int = 1, schedule: str = "1f1b",
           batch_size: int = 8, shard: int = 1, recompute: str = "none",
           tp: int = 1, experts: int = 0, ep: int = 1, precision: str = "", cp: int = 1
           ) -> dict[str, list[float]]:
    """Run 20 steps of a tiny GPT in the current process group; per-step losses and gradient
    norms (a tied weight counted once, and clipped at 1.0 the same in every layout). `experts`:
    a mixture of that many experts (top 2) in each block, split over `ep` processes; `cp`: each
    sequence split over that many."""
    vocab, train, val = load_text_data("", 32, 0.1)
    torch.manual_seed(0)
    blocks = gpt(GPTConfig(len(vocab), 32, n_layer=2, n_head=2, n_embd=32, dropout=0.0, experts=experts))
    info = groups.init(threads=1)
    par = ParallelConfig(nproc=info.world_size, pp=pp, dp=info.world_size // (pp * tp * cp),
                         local_stages=local_stages, microbatches=2, schedule=schedule, shard=shard,
                         recompute=recompute, tp=tp, ep=ep, cp=cp)
    trainer = Trainer(blocks, gpt_loss, train, None, parallel=par,
                      optim=OptimConfig(warmup_steps=5, grad_accum=grad_accum),
                      train=TrainConfig(max_steps=STEPS, batch_size=batch_size, precision=precision),
                      metrics=False)
    history = trainer.fit()
    _assert_copies_equal(trainer)
    trainer.close()
    groups.destroy()
    return {k: [r[k] for r in history if "loss" in r] for k in ("loss", "grad_norm")}


def _assert_same(got: dict, want: dict, rank: int = 0) -> None:
    for key in ("loss", "grad_norm"):
        assert got[key] == pytest.approx(want[key], abs=FP32_ABS), f"rank {rank}: {key}"


def _assert_copies_equal(trainer: Trainer) -> None:
    """Every copy of a shared parameter, on whichever rank, equals its canonical one bit for bit."""
    from brigade.dtensors import full
    from brigade.snapshot.format import tensor_sha256

    mine = {n: tensor_sha256(full(p)) for n, p in trainer.model.named_parameters(remove_duplicate=False)}
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    held = {n: h for part in parts for n, h in part.items()}
    assert trainer.model.aliases == {"blocks.3.out.weight": "blocks.0.tok.weight"}
    for alias, canonical in trainer.model.aliases.items():
        assert held[alias] == held[canonical], f"{alias} drifted from {canonical}"


@pytest.fixture(scope="session")  # not module: xdist interleaves modules, which tears it down
def reference():
    import multiprocessing as mp

    # A fresh process: the single-device run must not share this one's process group.
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(losses)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", [
    dict(nproc=2),                      # dp = 2
    dict(nproc=2, pp=2),                # pp = 2
    dict(nproc=2, local_stages=2),      # dp = 2 × local-pp = 2
    dict(nproc=2, pp=2, schedule="zb"),  # pp = 2, zero-bubble schedule
    dict(nproc=4, pp=2),                # dp = 2 × pp = 2
    dict(nproc=4, pp=2, schedule="zb"),  # dp = 2 × pp = 2, zero-bubble
    dict(nproc=2, local_stages=2, schedule="zb"),  # dp = 2 × local-pp = 2, zero-bubble
    dict(nproc=2, pp=2, schedule="zbv"),  # pp = 2, two stages per rank in a V
    dict(nproc=4, pp=2, schedule="interleaved"),  # dp = 2 × pp = 2, two stages per rank
    dict(nproc=2, local_stages=2, schedule="looped-bfs"),  # dp = 2 × local-pp = 2, two per device
    dict(nproc=2, pp=2, schedule="interleaved"),  # pp = 2, two stages per rank: the tie on both ranks
    dict(nproc=4, pp=2, shard=2),       # shard = 2 × pp = 2 (FSDP2 per stage)
    dict(nproc=4, pp=2, shard=2, schedule="zb"),  # shard = 2 × pp = 2, split backward
    dict(nproc=4, pp=2, shard=2, schedule="zbv"),  # shard = 2 × pp = 2, the tie's copies on rank 0
    dict(nproc=4, shard=2),             # HSDP: 2 replicas × shard 2
    dict(nproc=2, pp=2, schedule="zb", recompute="full"),  # I and W share one recompute
    dict(nproc=4, pp=2, shard=2, recompute="selective"),  # shard = 2 × pp = 2, selective recompute
    dict(nproc=2, tp=2),                # tp = 2: every block's matmuls split over both
    dict(nproc=4, pp=2, tp=2),          # tp = 2 × pp = 2
    dict(nproc=4, pp=2, tp=2, schedule="zbv"),  # tp = 2 × pp = 2, split backward, the tie on rank 0
    dict(nproc=4, tp=2),                # dp = 2 × tp = 2 (FSDP2 replicating, shard 1)
], ids=["dp2", "pp2", "dp2xlocal2", "pp2-zb", "dp2xpp2", "dp2xpp2-zb", "dp2xlocal2-zb", "pp2-zbv",
        "dp2xpp2-interleaved", "dp2xlocal2-looped-bfs", "pp2-interleaved", "shard2xpp2", "shard2xpp2-zb",
        "shard2xpp2-zbv", "hsdp2x2", "pp2-zb-full", "shard2xpp2-selective", "tp2", "tp2xpp2",
        "tp2xpp2-zbv", "dp2xtp2"])
def test_layouts_match_a_single_device(reference, layout):
    nproc = layout.pop("nproc")
    results = agent.launch(losses, nproc, layout.get("pp", 1), layout.get("local_stages", 1), 1,
                           layout.get("schedule", "1f1b"), 8, layout.get("shard", 1),
                           layout.get("recompute", "none"), layout.get("tp", 1))
    assert len(reference["loss"]) == STEPS
    for rank, got in results.items():
        _assert_same(got, reference, rank)
    assert reference["loss"][-1] < reference["loss"][0]  # it trains


@pytest.fixture(scope="session")
def moe_reference():
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(losses, kwds={"experts": 4})


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [
    dict(nproc=2, ep=2),                                   # dp = ep = 2: two experts each
    dict(nproc=4, pp=2, ep=2, schedule="zb"),              # dp 2 × pp 2, split backward
    dict(nproc=4, pp=2, ep=2, shard=2, schedule="zbv"),    # FSDP2, experts over edp 1
    dict(nproc=4, ep=2, shard=4),                          # FSDP2 over 4, experts over ep 2 × edp 2
], ids=["dp2-ep2", "dp2xpp2-ep2-zb", "shard2xpp2-ep2-zbv", "shard4-ep2"])
def test_expert_parallel_layouts_match_a_single_device(moe_reference, layout):
    """A mixture of 4 experts in each block, its balancing loss on: 20 steps of each layout give
    one device's losses and gradient norms (clipped), each expert group's gradients summed over
    the processes holding the same experts, each expert counted once in the norm."""
    nproc = layout.pop("nproc")
    results = agent.launch(losses, nproc, layout.get("pp", 1), 1, 1, layout.get("schedule", "1f1b"), 8,
                           layout.get("shard", 1), "none", 1, 4, layout["ep"])
    for rank, got in results.items():
        _assert_same(got, moe_reference, rank)
    assert moe_reference["loss"][-1] < moe_reference["loss"][0]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shard", [1, 2], ids=["autocast", "fsdp2-mixed"])
def test_expert_parallel_trains_in_bf16_as_fp32_does(moe_reference, shard):
    """bf16 with the experts split over ep 2 of dp 2 × pp 2: autocast over fp32 weights (DDP), or
    FSDP2's mixed precision (the experts gathered as bf16 over their own unit): the losses follow
    fp32's within bf16's rounding, and fall as they do."""
    got = agent.launch(losses, 4, 2, 1, 1, "1f1b", 8, shard, "none", 1, 4, 2, "bf16")[0]
    assert got["loss"] == pytest.approx(moe_reference["loss"], abs=BF16_ABS)
    assert got["loss"][-1] < got["loss"][0] - 0.3


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [
    dict(nproc=2),                                  # cp 2: DDP over the two parts
    dict(nproc=4, pp=2, schedule="zb"),             # cp 2 × pp 2, split backward
    dict(nproc=4, shard=2),                         # dp 2 × cp 2: FSDP2 over shard × cp = 4
    dict(nproc=4, recompute="selective"),           # dp 2 × cp 2 (DDP over 4), selective recompute
], ids=["cp2", "cp2xpp2-zb", "shard2xcp2", "dp2xcp2-selective"])
def test_context_parallel_layouts_match_a_single_device(reference, layout):
    """Each sequence split over 2 processes (all-to-all attention, the embedding at its part's
    global positions, each part's loss by its share): 20 steps give one device's losses and
    gradient norms, the parts' gradients averaged with the replicas'."""
    nproc = layout.pop("nproc")
    results = agent.launch(losses, nproc, layout.get("pp", 1), 1, 1, layout.get("schedule", "1f1b"), 8,
                           layout.get("shard", 1), layout.get("recompute", "none"), 1, 0, 1, "", 2)
    for rank, got in results.items():
        _assert_same(got, reference, rank)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shard", [1, 2], ids=["autocast", "fsdp2-mixed"])
def test_context_parallel_trains_in_bf16_as_fp32_does(reference, shard):
    """bf16 with each sequence over cp 2 of dp 2 × cp 2: autocast over fp32 weights (DDP over
    dp × cp), or FSDP2's mixed precision over shard × cp: the losses follow fp32's within bf16's
    rounding, and fall as they do."""
    got = agent.launch(losses, 4, 1, 1, 1, "1f1b", 8, shard, "none", 1, 0, 1, "bf16", 2)[0]
    assert got["loss"] == pytest.approx(reference["loss"], abs=BF16_ABS)
    assert got["loss"][-1] < got["loss"][0] - 0.3


@pytest.mark.timeout(120)
def test_gradient_accumulation_matches_one_big_batch(reference):
    got = agent.launch(losses, 2, 1, 1, 2)[0]  # dp=2, two accumulated halves per replica
    _assert_same(got, reference)


@pytest.mark.timeout(120)
def test_sharded_gradient_accumulation_reduces_once_per_step(reference):
    """shard 2, two accumulated halves per replica: the first half's backward adds into the gathered
    gradients and only the step's last one reduce-scatters."""
    got = agent.launch(losses, 2, 1, 1, 2, "1f1b", 8, 2)[0]
    _assert_same(got, reference)


@pytest.mark.timeout(180)
def test_zero_bubble_gradient_accumulation_under_data_parallel(reference):
    """dp 2 × local-pp 2 under zb, two accumulated halves per replica: reduced once per step."""
    results = agent.launch(losses, 2, 1, 2, 2, "zb")
    for rank, got in results.items():
        _assert_same(got, reference, rank)
