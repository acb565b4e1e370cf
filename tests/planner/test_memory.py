"""The memory model's split-backward term (`planner.memory`): what a stage keeps from a micro-batch's
I to its W, measured per block as the gradient at each weight's output, counted for the
micro-batches past their I at the stage's busiest moment; and 0 wherever every backward is whole."""

import pytest

from brigade.models import load_model
from brigade.models.gpt import GPTConfig
from brigade.pipeline.plans.action import Action, Op
from brigade.pipeline.plans.schedule import build
from brigade.planner.cluster import Cluster
from brigade.planner.costs import ModeCosts, ModelCosts, measure_memory
from brigade.planner.devices import TABLE
from brigade.planner.memory import block_by_block, block_transient, moments, rank_memory
from brigade.planner.predict import predict
from brigade.planner.space import Layout

HELD, KEPT, OUT = 10.0, 6.0, 2.0  # bytes per sample of each block (hand-made costs below)


def _costs(kept: float = KEPT) -> ModelCosts:
    """Four blocks of one parameter each; every block holds HELD, keeps `kept` from I to W."""
    n = 4
    mode = ModeCosts({1: [(1.0, 2.0, 1.0, 1.0)] * n, 4: [(4.0, 8.0, 4.0, 4.0)] * n}, held=[HELD] * n,
                     working=[0.0] * n, transient=[1.0] * n, kept=[kept] * n)
    return ModelCosts("m", [{b: 100} for b in range(n)], [1.0] * n, [OUT] * n, {"none": mode}, 0.0,
                      TABLE["h100"])


def test_moments_count_micro_batches_past_their_i_until_their_w():
    # zb's last stage of two: F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3; its first stage runs B only
    # (held, past I, gradients made): made from the first W on (the last stage) or B (the first)
    zb = moments(build("zb", 2, 4))
    assert zb[1] == {(1, 0, 0), (1, 1, 0), (2, 1, 0), (2, 2, 0), (1, 1, 1), (2, 1, 1), (2, 2, 1), (0, 0, 1)}
    # 0F0 0F1 0F2 0B0 0B1 0F3 0B2 0B3: whole backwards (j = 0); three held before any gradient
    assert zb[0] == {(1, 0, 0), (2, 0, 0), (3, 0, 0), (2, 0, 1), (1, 0, 1), (0, 0, 1)}
    assert all(j == 0 for pairs in moments(build("1f1b", 3, 6)).values() for _, j, _ in pairs)
    by_hand = {0: [Action(0, Op.F, 0), Action(0, Op.F, 1), Action(0, Op.I, 1), Action(0, Op.W, 1)]}
    assert moments(by_hand) == {0: {(1, 0, 0), (2, 0, 0), (2, 1, 0), (1, 0, 1)}}


def test_split_is_kept_times_the_micro_batches_past_i_at_the_busiest_moment():
    lay = Layout(1, 1, 2, "zb", 1, 4, "none")
    at = moments(build("zb", 2, 4))
    last = rank_memory(_costs(), lay, [2, 2], {0: 3, 1: 2}, mb=3, pp_rank=1, moments=at)
    assert last["split"] == 2 * KEPT * 3 * 2  # 2 blocks × KEPT × 3 samples × 2 past I (after I1)
    assert last["activations"] == 2 * HELD * 3 * 2
    assert last["peak"] == rank_memory(_costs(), lay, [2, 2], {0: 3, 1: 2}, 3, 1)["peak"] + last["split"]
    # the busiest moment is the most bytes, not the most held: 2 held both past I beats 3 held, 0 past
    busy = rank_memory(_costs(kept=HELD), lay, [2, 2], {0: 3, 1: 3}, 1, 1,
                       moments={1: {(3, 0, 0), (2, 2, 0)}})
    assert busy["split"] == (2 * 2 * HELD + 2 * 2 * HELD) - 3 * 2 * HELD


def test_a_first_stage_keeps_the_gradient_its_output_received_and_whole_backwards_nothing():
    lay = Layout(1, 1, 2, "zb", 1, 4, "none")
    first = rank_memory(_costs(), lay, [2, 2], {0: 2, 1: 1}, mb=3, pp_rank=0, moments={0: {(2, 2, 1)}})
    assert first["split"] == 2 * OUT * 3  # its input takes no gradient: I does nothing, W the rest
    f1b = Layout(1, 1, 2, "1f1b", 1, 4, "none")
    for r in range(2):
        whole = rank_memory(_costs(), f1b, [2, 2], {0: 2, 1: 1}, 3, r, moments(build("1f1b", 2, 4)))
        assert whole["split"] == 0 and whole == rank_memory(_costs(), f1b, [2, 2], {0: 2, 1: 1}, 3, r)
        # 1F1B's busiest moment on either stage already has the gradients: the upper bound holds


def test_zb_predicts_more_than_1f1b_by_one_more_held_micro_batch_and_what_two_keep():
    cluster = Cluster(1, 2, TABLE["h100"])
    rows = {s: predict(_costs(), Layout(1, 1, 2, s, 1, 4, "none"), cluster, batch=16, seq_len=1)
            for s in ("1f1b", "zb")}
    assert rows["zb"]["balance"] == rows["1f1b"]["balance"] == [2, 2]
    zb, f1b = (rows[s]["memory_per_stage_rank"][1] for s in ("zb", "1f1b"))
    mb = 4
    assert zb["split"] == 2 * KEPT * mb * 2 and f1b["split"] == 0
    assert zb["peak"] - f1b["peak"] == pytest.approx(2 * HELD * mb * (2 - 1) + zb["split"])
    without = predict(_costs(kept=0.0), Layout(1, 1, 2, "zb", 1, 4, "none"), cluster, 16, 1)
    assert zb["peak"] - without["memory_per_stage_rank"][1]["peak"] == pytest.approx(zb["split"])


def test_kept_is_the_gradient_at_each_weights_output_and_under_recompute_what_i_made_again():
    cfg = GPTConfig(vocab_size=96, block_size=32, n_layer=2, n_head=2, n_embd=64)
    costs = measure_memory(load_model("gpt", seed=0, gpt_cfg=cfg), 4, ["none", "full"])
    t, c, v = cfg.block_size, cfg.n_embd, cfg.vocab_size
    none, full = costs.modes["none"], costs.modes["full"]
    # a transformer block's weights see outputs of c_attn 3C, attn proj C, fc 4C, mlp proj C, 2 LayerNorms C
    assert none.kept[1:3] == [11 * c * t * 4] * 2
    assert none.kept[3] == (c + v) * t * 4  # the head: its LayerNorm, its vocabulary projection
    for b in range(1, 4):  # recomputed, the input pass's tensors (all but the kept input) stay too
        assert full.kept[b] == pytest.approx(none.kept[b] + none.held[b] - full.held[b], rel=0.01)
    assert costs.out_bytes[:3] == [c * t * 4] * 3  # what a first stage keeps: its output's gradient


def _dp_layout() -> Layout:
    return Layout(2, 1, 1, "1f1b", 1, 1, "none")


def test_one_micro_batch_peaks_at_the_larger_of_its_activations_and_gradients():
    # a backward frees a block's activations as it makes its gradients: the whole model's one
    # micro-batch holds all activations first (F0 done), then all gradients (B0 done), never both
    one = moments(build("1f1b", 1, 1))
    assert one == {0: {(1, 0, 0), (0, 0, 1)}}
    grads = 4 * 100  # four blocks of one 100-byte parameter
    for mb in (2, 40):  # activations 4 × HELD × mb: 80 (below the gradients), then 1600 (above)
        row = rank_memory(_costs(), _dp_layout(), [4], {0: 1}, mb, 0, one)
        base = 3 * grads + grads  # params + AdamW's two moments + DDP's buckets
        assert row["peak"] == base + max(4 * HELD * mb, grads) + 1.0 * mb  # + the block's transient
        upper = rank_memory(_costs(), _dp_layout(), [4], {0: 1}, mb, 0)  # no moments: both at once
        assert upper["peak"] == base + 4 * HELD * mb + grads + 1.0 * mb


def test_the_optimizer_step_is_a_phase_of_its_own_its_temporaries_on_top_of_the_gradients():
    costs = _costs()
    costs.opt_transient = [250.0, 50.0, 50.0, 50.0]
    one = moments(build("1f1b", 1, 1))
    row = rank_memory(costs, _dp_layout(), [4], {0: 1}, 2, 0, one)
    # one tensor at a time: the largest block's 250 on top of the 400 bytes of gradients
    assert row["optimizer_step"] == 250.0
    assert row["peak"] == 4 * 400 + 400 + 250.0
    costs.opt_foreach = True  # a foreach update: every block's temporaries at once
    assert rank_memory(costs, _dp_layout(), [4], {0: 1}, 2, 0, one)["optimizer_step"] == 400.0
    sharded = rank_memory(costs, Layout(1, 2, 1, "1f1b", 1, 1, "none"), [4], {0: 1}, 2, 0, one)
    assert sharded["optimizer_step"] == 200.0  # each process steps its half of every parameter


def test_optimizer_transient_is_measured_per_block_as_adamw_runs_here():
    from torch import nn

    from brigade.planner.optimizer import optimizer_transient

    blocks = [nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 256)]
    per, foreach = optimizer_transient(blocks)
    assert per[1] == 0.0  # no parameters, no step
    for b in (0, 2):  # fused (--adamw auto on a CPU) updates in place: nothing near a parameter's size
        assert 0.0 <= per[b] < min(p.numel() * 4 for p in blocks[b].parameters())
    assert foreach is False  # nor a copy of them all, as foreach would allocate


def test_sharded_stages_count_their_gradients_beside_their_activations_at_every_moment():
    mb = 40  # activations 1600 bytes per block-stage pair below, whole gradients 400
    # under a pipeline (pp 2): the stage's gathered weights and whole gradients, kept for the step
    piped = rank_memory(_costs(), Layout(1, 2, 2, "1f1b", 1, 1, "none"), [2, 2], {0: 1, 1: 1}, mb, 0,
                        moments(build("1f1b", 2, 1)))
    whole, mine = 200, 100  # the rank's two blocks
    assert piped["peak"] == 3 * mine + (whole - mine) + 2 * HELD * mb + whole + 1.0 * mb
    # without one (pp 1): FSDP block by block, two blocks gathered (fp32 beyond the shard) and one
    # block's gradient and its flat copy reducing; the sharded gradients are made as the backward
    # frees the activations, so beside them only from the second micro-batch on
    alone = rank_memory(_costs(), Layout(1, 2, 1, "1f1b", 1, 1, "none"), [4], {0: 1}, mb, 0,
                        moments(build("1f1b", 1, 1)))
    mine = 400 / 2
    assert alone["peak"] == 3 * mine + 4 * HELD * mb + 1.0 * mb + 200 / 2 + 100 * 2
    two = rank_memory(_costs(), Layout(1, 2, 1, "1f1b", 1, 2, "none"), [4], {0: 1}, mb, 0,
                      moments(build("1f1b", 1, 2)))
    assert two["peak"] == alone["peak"] + mine


def test_block_by_block_gathers_the_roots_blocks_and_two_neighbours():
    tied = _costs()
    tied.params[3] = {0: 100}  # the last block shares the first's weight: both left to the root
    assert block_by_block(tied, [0, 1, 2, 3], 1) == (100 + 200, 100 + 100)
    assert block_by_block(_costs(), [0, 1, 2, 3], 1) == (200, 100)
    assert block_by_block(_costs(), [2], 1) == (100, 100)  # one block: itself


def _parts(layout: Layout, precision: str) -> dict:
    return rank_memory(_costs(), layout, [4], {0: 1}, mb=2, pp_rank=0, precision=precision)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_under_sharding_halves_activations_and_gathers_a_half_copy(precision):
    """FSDP2's mixed precision (shard 2): fp32 states ÷ shard as in fp32, activations half, the
    gathered weights half-precision ones, the backward's gradients the fp32 ones."""
    shard = Layout(1, 2, 1, "1f1b", 1, 1, "none")
    fp32, half = _parts(shard, ""), _parts(shard, precision)
    whole = 4 * 100  # four blocks of 100 fp32 bytes
    assert half["params"] == fp32["params"] == whole / 2 and half["optimizer"] == whole
    assert half["activations"] == fp32["activations"] / 2 == 4 * HELD * 2 / 2
    # no pipeline: params + optimizer + the backward (activations, sharded gradients, a block's
    # transient, two blocks gathered, one block's gradient reducing: in half precision and fp32)
    assert fp32["peak"] == whole / 2 + whole + (4 * HELD * 2 + whole / 2 + 1.0 * 2) + 200 / 2 + 100 * 2
    assert half["peak"] == whole / 2 + whole + (4 * HELD * 2 / 2 + whole / 2 + 1.0 * 2 / 2) + 200 / 2 \
        + 100 * 1.5
    # under a pipeline the stage keeps a whole half-precision copy and its whole fp32 gradients
    piped = rank_memory(_costs(), Layout(1, 2, 2, "1f1b", 1, 1, "none"), [2, 2], {0: 1, 1: 1}, mb=2,
                        pp_rank=0, precision=precision)
    assert piped["peak"] == 100 + 200 + 200 / 2 + (2 * HELD * 2 / 2 + 200 + 1.0 * 2 / 2)


def test_half_precision_without_sharding_is_autocast_and_counted_as_fp32():
    for layout in (Layout(2, 1, 1, "1f1b", 1, 1, "none"), Layout(1, 1, 2, "1f1b", 1, 2, "none")):
        balance = [4] if layout.pp == 1 else [2, 2]
        args = (_costs(), layout, balance, {0: 1, 1: 1}, 2, 0)
        assert rank_memory(*args, precision="bf16") == rank_memory(*args, precision="")


def test_a_formula_costs_parameters_at_fp32_whatever_the_model_was_built_in():
    import torch

    from brigade.planner.costs import master_bytes

    built = [torch.nn.Linear(4, 4).to(torch.bfloat16)]
    assert list(master_bytes(built)[0].values()) == [16 * 4, 4 * 4]  # weight, bias: 4 bytes each


def test_a_backward_adding_into_made_gradients_counts_its_own_temporaries_and_newest_gradient():
    costs, adding = _costs(), _costs()
    adding.modes["none"].accumulating = [5.0] * 4
    pp = Layout(1, 1, 2, "1f1b", 1, 4, "none")
    at = moments(build("1f1b", 2, 4))
    first = rank_memory(costs, pp, [2, 2], {0: 2, 1: 1}, mb=3, pp_rank=0, moments=at)
    later = rank_memory(adding, pp, [2, 2], {0: 2, 1: 1}, mb=3, pp_rank=0, moments=at)
    # stage 0's B1 runs with B0's gradients made: a block's 100-byte gradient before it is added,
    # and 5 bytes a sample of its own temporaries, in place of the first backward's 1 a sample
    assert later["peak"] - first["peak"] == pytest.approx(100 + 5 * 3 - 1 * 3)
    # one micro-batch (data parallel's whole model): no backward adds into gradients made
    dp = Layout(2, 1, 1, "1f1b", 1, 1, "none")
    assert block_transient(adding, dp, [0, 1, 2, 3], 3.0, adding=False) == 1 * 3
    assert block_transient(adding, dp, [0, 1, 2, 3], 3.0, adding=True) == 100 + 5 * 3
    assert block_transient(costs, dp, [0, 1, 2, 3], 3.0, adding=True) == 1 * 3  # not measured: the first's
