"""examples/llama.py: trains as one sequential composition, and equals its blocks run by hand."""

import copy
from pathlib import Path

import pytest
import torch

from brigade.models import load_model
from brigade.pipeline.batches import microbatch
from brigade.pipeline.stages import side_inputs, ties
from brigade.pipeline.stages.side_inputs import StageModule

FILE = Path(__file__).resolve().parents[2] / "examples" / "llama.py"
SPEC = f"{FILE}:model"


@pytest.fixture(scope="module")
def llama():
    spec = load_model(SPEC, seed=0)
    return spec, __import__(spec.loss_fn.__module__)


def inputs(spec, n=6, seed=0):
    return spec.make_batch(n, torch.Generator().manual_seed(seed))


def test_the_file_loads_as_a_model_with_batch_and_loss(llama):
    spec, _ = llama
    assert len(spec.blocks) == 6 and spec.loss_fn.__name__ == "loss"
    x, y = inputs(spec)
    assert set(x) == {"tokens", "positions"}
    assert x["tokens"].shape == y.shape == x["positions"].shape == (6, 32)
    assert (x["positions"] == torch.arange(32)).all()
    assert (y[:, :-1] == x["tokens"][:, 1:]).all(), "each target is the next token"
    (tie,) = ties.find_shared(spec.blocks)
    assert tie.uses == ((0, "tok.weight"), (5, "out.weight"))


def test_stage_module_equals_the_blocks_by_hand(llama):
    spec, _ = llama
    x, _ = inputs(spec)
    main, extra = side_inputs.split_inputs(x, spec.blocks)
    assert main is x["tokens"] and list(extra) == ["positions"]
    h = main
    for block in spec.blocks:
        h = block(h, **({"positions": x["positions"]} if side_inputs.declared(block) else {}))
    out = StageModule(spec.blocks)(main, extra)
    assert out.shape == (6, 32, 96)
    torch.testing.assert_close(out, h, rtol=0, atol=0)


def test_trains_on_one_process(llama):
    spec, _ = llama
    blocks = copy.deepcopy(spec.blocks)
    stage = StageModule(blocks)
    assert blocks[5].out.weight is blocks[0].tok.weight, "deepcopy keeps the tie"
    opt = torch.optim.AdamW(stage.parameters(), lr=3e-3)
    x, y = inputs(spec, n=8, seed=1)
    main, extra = side_inputs.split_inputs(x, blocks)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = spec.loss_fn(stage(main, extra), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_padding_at_the_end_does_not_leak_into_real_positions(llama):
    """Changing the tokens after position 20 (where a padded row's pads would be) changes no output
    before it: causal attention needs no mask for padding at the end."""
    spec, _ = llama
    stage = StageModule(spec.blocks).eval()
    x, _ = inputs(spec)
    main, extra = side_inputs.split_inputs(x, spec.blocks)
    noisy = main.clone()
    noisy[:, 20:] = 7
    torch.testing.assert_close(stage(main, extra)[:, :20], stage(noisy, extra)[:, :20])
    assert (stage(main, extra)[:, 20:] - stage(noisy, extra)[:, 20:]).abs().max() > 1e-3


def test_each_token_rotates_by_the_position_it_is_given(llama):
    """A part of a sequence given its global positions computes what the whole does there (what
    context parallel relies on); the same tokens numbered otherwise (the second half from 0
    again) attend otherwise: rotary embeddings see only positions' differences, so a part's
    queries and the other parts' keys must be numbered on one scale."""
    spec, _ = llama
    decoder = copy.deepcopy(spec.blocks[1]).eval()
    with torch.no_grad():  # weights large enough that attention moves the output visibly
        for p in decoder.parameters():
            p.normal_(std=0.3, generator=torch.Generator().manual_seed(1))
    h = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0))
    whole = decoder(h, positions=torch.arange(32).repeat(2, 1))
    first = decoder(h[:, :16], positions=torch.arange(16).repeat(2, 1))
    torch.testing.assert_close(first, whole[:, :16])  # causal: the first half sees only itself
    restarted = decoder(h, positions=torch.arange(16).repeat(2, 2))
    assert (restarted[:, 16:] - whole[:, 16:]).abs().max() > 1e-3



def test_microbatched_loss_equals_the_batch_loss(llama):
    """The loss is a mean over sequences, so micro-batch losses weighted by share add up."""
    spec, _ = llama
    stage = StageModule(spec.blocks)
    x, y = inputs(spec, n=7)
    main, extra = side_inputs.split_inputs(x, spec.blocks)
    full = spec.loss_fn(stage(main, extra), y)
    parts = zip(microbatch.split_structure((main, extra), 3, 7), microbatch.split(y, 3),
                microbatch.weights(7, 3))
    summed = sum(spec.loss_fn(stage(m, e), t) * w for (m, e), t, w in parts)
    torch.testing.assert_close(summed, full)


def test_bad_sizes_are_refused(llama):
    _, module = llama
    with pytest.raises(ValueError, match=r"n_kv_head=3: need .*n_kv_head \| n_head"):
        module.model(n_head=4, n_kv_head=3)
