"""Sequence parallel (brigade/parallel/sequence.py): under tp 2 the GPT's blocks take and give half
of the sequence, the embedding and head stay whole, the norms' gradients come back partial and
are summed over tp into one gradient equal to one device's; with it off, everything between
blocks is whole again. Lengths tp does not divide, and a gathered module without a tensor input,
are one line.

Equality with one device under every registered schedule is tests/check/test_run.py's (its tensor
parallel grids run with sequence parallel on, its default) and tests/train/test_trainer.py's
(20 steps, gradient norms and clipping included)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from brigade.errors import BrigadeError
from brigade.models.gpt import GPTConfig, gpt, gpt_loss
from brigade.parallel.assemble import Cut
from brigade.parallel.sequence import gathering, takes_part

T = 8


def _tiny() -> list[nn.Module]:
    torch.manual_seed(0)
    return gpt(GPTConfig(vocab_size=16, block_size=T, n_layer=2, n_head=2, n_embd=8))


def _one_step(sequence_parallel: bool) -> dict:
    """Worker (tp 2, one stage): what each block gives, the norm's gradient before and after
    `settle_grads`, against one device's."""
    from brigade.config import ParallelConfig
    from brigade.dtensors import full
    from brigade.launcher import groups
    from brigade.parallel.assemble import Cut, assemble
    from brigade.train.process_model import world_of

    info = groups.init("gloo", threads=1)
    blocks = _tiny()
    reference = nn.Sequential(*copy.deepcopy(blocks))
    x = torch.randint(16, (2, T), generator=torch.Generator().manual_seed(1))
    y = torch.randint(16, (2, T), generator=torch.Generator().manual_seed(2))
    gpt_loss(reference(x), y).backward()
    world = world_of(ParallelConfig(nproc=2, dp=1, tp=2), info.device)
    built = assemble(blocks, Cut((4,), (0,)), world, sequence_parallel=sequence_parallel)
    shapes = []
    for b in built.held.values():
        b.register_forward_hook(lambda m, a, out: shapes.append(tuple(out.shape)))
    gpt_loss(built.stages[0](x), y).backward()
    ln = built.held[1].ln1.weight
    before = [type(p).__name__ for p in getattr(ln.grad, "placements", ())]
    built.settle_grads()
    after = [type(p).__name__ for p in getattr(ln.grad, "placements", ())]

    def diff(mine, theirs) -> float:
        return (full(mine.grad) - theirs.grad).abs().max().item()

    out = {"shapes": shapes, "before": before, "after": after,
           "ln1": diff(ln, reference[1].ln1.weight),
           "qkv": diff(built.held[1].attn.qkv.weight, reference[1].attn.qkv.weight),
           "tok": diff(built.held[0].tok.weight, reference[0].tok.weight)}
    groups.destroy()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on", [True, False], ids=["sequence-parallel", "off"])
def test_blocks_pass_parts_and_the_norms_gradients_are_summed(on):
    from brigade import launch

    for rank, got in launch(_one_step, 2, on).items():
        c = 8  # n_embd
        part = (2, T // 2, c) if on else (2, T, c)
        # embedding (whole, its output sliced by the next block's boundary), 2 blocks, head (whole)
        assert got["shapes"] == [(2, T, c), part, part, (2, T, 16)], rank
        assert got["before"] == (["Partial"] if on else []), rank  # off: a plain tensor, whole
        assert got["after"] == (["Replicate"] if on else []), rank
        assert max(got["ln1"], got["qkv"], got["tok"]) < 1e-6, (rank, got)


def test_only_plans_with_a_sequence_entry_take_part():
    blocks = _tiny()
    embedding, block, head = blocks[0], blocks[1], blocks[-1]
    assert takes_part(block, block.tp_plan) and not takes_part(embedding, {}) and not takes_part(head, None)
    assert not takes_part(block, {"attn.qkv": ("colwise", 2)})


def _odd_length() -> str:
    from brigade.config import ParallelConfig
    from brigade.launcher import groups
    from brigade.parallel.assemble import Cut, assemble
    from brigade.train.process_model import world_of

    info = groups.init("gloo", threads=1)
    built = assemble(_tiny(), Cut((4,), (0,)), world_of(ParallelConfig(nproc=2, dp=1, tp=2), info.device))
    try:
        built.stages[0](torch.zeros(2, T - 1, dtype=torch.long))
    except BrigadeError as e:
        return str(e)
    finally:
        groups.destroy()
    return "no error"


@pytest.mark.timeout(120)
def test_a_length_tp_does_not_divide_is_one_line():
    from brigade import launch

    message = launch(_odd_length, 2)[0]
    assert message.startswith("block 1 (Block): sequence parallel splits dimension 1 of a (2, 7, 8) tensor "
                              "over --tp 2, which does not divide it: use a sequence length (--block-size)")
    assert "--no-sequence-parallel" in message and "\n" not in message


def test_a_gathered_module_without_a_tensor_input_is_one_line():
    hook = gathering(mesh=None)
    with pytest.raises(BrigadeError, match="a 'gather' entry's Linear got no tensor to gather: its input "
                                           "must come first or as hidden_states="):
        hook(nn.Linear(2, 2), (), {"x": 1})


def _dropped(mode: str) -> dict:
    """Worker (tp 2, sequence parallel, dropout 0.5): the zero pattern of block 1's residual
    dropout on this process's part, the shared stream's next draw, and qkv's gradient under
    recompute `mode`."""
    from brigade.config import ParallelConfig
    from brigade.dtensors import full
    from brigade.launcher import groups
    from brigade.parallel.assemble import Cut, assemble
    from brigade.train.process_model import world_of

    info = groups.init("gloo", threads=1)
    torch.manual_seed(0)
    blocks = gpt(GPTConfig(vocab_size=16, block_size=T, n_layer=2, n_head=2, n_embd=8, dropout=0.5))
    world = world_of(ParallelConfig(nproc=2, dp=1, tp=2), info.device)
    built = assemble(blocks, Cut((4,), (0,)), world, mode)
    zeros = []
    built.held[1].attn.drop.register_forward_hook(lambda m, a, out: zeros.append((out == 0).tolist()))
    torch.manual_seed(7)  # the shared stream, alike on both tp processes
    x = torch.randint(16, (2, T), generator=torch.Generator().manual_seed(1))
    gpt_loss(built.stages[0](x), x).backward()
    built.settle_grads()
    out = {"zeros": zeros[0], "next": torch.rand(3).tolist(),
           "qkv": full(built.held[1].attn.qkv.weight.grad).tolist()}
    groups.destroy()
    return out


@pytest.mark.timeout(120)
def test_each_part_draws_its_own_dropout_masks_and_recompute_replays_them():
    from brigade import launch

    plain, again = launch(_dropped, 2, "none"), launch(_dropped, 2, "full")
    assert plain[0]["zeros"] != plain[1]["zeros"]  # two parts of one sequence: two masks
    assert plain[0]["next"] == plain[1]["next"] == again[0]["next"]  # the shared stream, advanced alike
    for rank in (0, 1):  # recompute draws the same masks again: the same gradient
        got, want = torch.tensor(again[rank]["qkv"]), torch.tensor(plain[rank]["qkv"])
        assert (got - want).abs().max().item() < 1e-6, rank


def _held_bytes(parts: bool) -> int:
    """Worker (tp 2, sequence parallel, no recompute): the bytes held for backward after one
    forward (`parallel.held`), with the gathered modules saving parts or, `parts` False, whole."""
    from unittest import mock

    from brigade.config import ParallelConfig
    from brigade.launcher import groups
    from brigade.parallel import assemble as assembling
    from brigade.parallel.held import Held
    from brigade.train.process_model import world_of

    info = groups.init("gloo", threads=1)
    world = world_of(ParallelConfig(nproc=2, dp=1, tp=2), info.device)
    with mock.patch.object(assembling, "_save_parts", assembling._save_parts if parts else lambda *a: None):
        built = assembling.assemble(_tiny(), Cut((4,), (0,)), world)
    x = torch.randint(16, (2, T), generator=torch.Generator().manual_seed(1))
    with Held() as held:
        loss = gpt_loss(built.stages[0](x), x)
    now = held.now
    loss.backward()  # gathers the parts again
    groups.destroy()
    return now


@pytest.mark.timeout(120)
def test_gathered_modules_save_parts_and_gather_them_again_in_the_backward():
    from brigade import launch

    whole, parts = launch(_held_bytes, 2, False)[0], launch(_held_bytes, 2, True)[0]
    # 2 blocks × 2 gathered modules (attn, mlp), each holding a part (2, 4, 8) in place of the
    # whole (2, 8, 8) in fp32; the gradients' equality with one device is test_blocks_pass_parts'
    assert whole - parts == 2 * 2 * (2 * 8 * 8 - 2 * 4 * 8) * 4
