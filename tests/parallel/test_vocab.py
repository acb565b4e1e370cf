"""A head that splits its vocabulary under tensor parallel (brigade/parallel/vocab.py and the
"vocab" style of brigade/parallel/tensor.py): each tp process holds V/tp of the logits, and the
loss of those split logits, its gradients, and the step's gradients equal one device's, with
sequence parallel on and off, and with an ignored target (a loss mask); a vocabulary tp does
not divide leaves the head whole; a "vocab" entry anywhere but on the head's last layer is one
line.

Equality under every registered schedule is tests/check/test_run.py's (its tp grid's GPT has an
untied head) and tests/check/test_hf.py's (an untied qwen2, slow)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from brigade.errors import BrigadeError
from brigade.models.gpt import GPTConfig, gpt
from brigade.parallel.tensor import check_plans, splits_vocab

T = 8


def _tiny(vocab: int = 16, tie: bool = False) -> list[nn.Module]:
    torch.manual_seed(0)
    return gpt(GPTConfig(vocab_size=vocab, block_size=T, n_layer=2, n_head=2, n_embd=8, tie_embeddings=tie))


def _masked_loss(logits, targets):  # an ignored target, as a prompt's loss mask gives
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def _one_step(sequence_parallel: bool, vocab: int) -> dict:
    """Worker (tp 2, one stage): the head's output, and the loss and every gradient against one
    device's."""
    from brigade.config import ParallelConfig
    from brigade.dtensors import full
    from brigade.launcher import groups
    from brigade.parallel.assemble import Cut, assemble
    from brigade.parallel.vocab import split_loss
    from brigade.train.process_model import world_of

    info = groups.init("gloo", threads=1)
    blocks = _tiny(vocab)
    reference = nn.Sequential(*copy.deepcopy(blocks))
    x = torch.randint(vocab, (2, T), generator=torch.Generator().manual_seed(1))
    y = torch.randint(vocab, (2, T), generator=torch.Generator().manual_seed(2))
    y[0, :3] = -100
    expected = _masked_loss(reference(x), y)
    expected.backward()
    world = world_of(ParallelConfig(nproc=2, dp=1, tp=2), info.device)
    built = assemble(blocks, Cut((4,), (0,)), world, sequence_parallel=sequence_parallel)
    logits = built.stages[0](x)
    loss = split_loss(_masked_loss)(logits, y)
    loss.backward()
    built.settle_grads()
    grads = dict(reference.named_parameters())
    worst = max((full(p.grad) - grads[n].grad).abs().max().item()
                for n, p in built.stages[0].named_parameters())
    out = {"kind": type(logits).__name__, "local": tuple(getattr(logits, "_local_tensor", logits).shape),
           "loss": abs(loss.item() - expected.item()), "plain": type(loss).__name__, "grads": worst}
    groups.destroy()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on", [True, False], ids=["sequence-parallel", "off"])
def test_the_head_splits_its_vocabulary_and_the_loss_and_gradients_equal_one_device(on):
    from brigade import launch

    for rank, got in launch(_one_step, 2, on, 16).items():
        assert got["kind"] == "DTensor" and got["local"] == (2, T, 8), rank  # V/tp on each
        assert got["plain"] == "Tensor", rank  # what the pipeline adds up and logs
        assert got["loss"] < 1e-6 and got["grads"] < 1e-6, (rank, got)


@pytest.mark.timeout(120)
def test_a_vocabulary_tp_does_not_divide_keeps_the_head_whole():
    from brigade import launch

    assert not splits_vocab(_tiny(15)[-1], 2) and splits_vocab(_tiny(16)[-1], 2)
    for rank, got in launch(_one_step, 2, True, 15).items():
        assert got["kind"] == "Tensor" and got["local"] == (2, T, 15), rank
        assert got["loss"] < 1e-6 and got["grads"] < 1e-6, (rank, got)


def test_a_tied_head_stays_whole():
    head = _tiny(tie=True)[-1]
    assert head.tp_plan == {} and not splits_vocab(head, 2)


@pytest.mark.parametrize("move, message", [
    ("body", "block 1 (Block) of the model splits its output as 'vocab', but only the last block's "
             "output goes to the loss"),
    ("norm", "block 3 (Head) of the model's tp_plan splits ln, a LayerNorm, as vocab: that style "
             "splits an output head's nn.Linear only"),
])
def test_vocab_off_the_heads_last_layer_is_one_line(move, message):
    blocks = _tiny()
    if move == "body":
        blocks[1].tp_plan = {**blocks[1].tp_plan, "mlp.2": "vocab"}
    else:
        blocks[-1].tp_plan = {"ln": "vocab"}
    with pytest.raises(BrigadeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_plans(blocks, 2)
