import pytest
import torch
from torch import nn

from brigade.errors import BrigadeError
from brigade.pipeline.stages import side_inputs
from brigade.pipeline.stages.side_inputs import StageModule
from brigade.pipeline.stages.structure import StructureError


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, tokens):  # (B, T) -> (B, T, 4)
        return self.emb(tokens)


class Masked(nn.Module):
    side_inputs = ("mask",)

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, *, mask):  # (B, T, 4), (B, T) -> (B, T, 4)
        return self.lin(x) * mask[..., None]


class Pair(nn.Module):
    side_inputs = ("mask", "scale")

    def forward(self, x, **extra):  # -> {"h": (B, T, 4), "n": int}
        return {"h": x * extra["scale"], "n": int(extra["mask"].sum())}


class TakesDict(nn.Module):
    def forward(self, d):
        return d.get("h") + d.get("n")


def batch():
    return {"tokens": torch.randint(10, (3, 5)), "mask": torch.ones(3, 5), "scale": torch.tensor(2.0)}


def test_split_inputs_takes_out_declared_keys():
    blocks = [Embed(), Masked(), Pair()]
    inputs = batch()
    main, extra = side_inputs.split_inputs(inputs, blocks)
    assert main is inputs["tokens"] and list(extra) == ["mask", "scale"]
    assert side_inputs.needed(blocks) == {"mask": 1, "scale": 2}


def test_without_declarations_the_inputs_are_the_main_input():
    d = {"a": torch.ones(1), "b": torch.ones(1)}
    assert side_inputs.split_inputs(d, [Embed()]) == (d, {})
    t = torch.ones(2)
    assert side_inputs.split_inputs(t, [Embed()])[0] is t


def test_stage_module_passes_side_inputs_and_matches_by_hand():
    torch.manual_seed(0)
    blocks = [Embed(), Masked(), Pair(), TakesDict()]
    main, extra = side_inputs.split_inputs(batch(), blocks)
    stage = StageModule(blocks)
    by_hand = blocks[0](main)
    by_hand = blocks[1](by_hand, mask=extra["mask"])
    by_hand = blocks[3](blocks[2](by_hand, mask=extra["mask"], scale=extra["scale"]))
    assert torch.equal(stage(main, extra), by_hand)
    assert stage.side_inputs == ("mask", "scale")


def test_stage_module_names_parameters_by_model_index():
    stage = StageModule([Masked(), Masked()], indices=[3, 4], stage=1)
    names = [n for n, _ in stage.named_parameters()]
    assert names == ["3.lin.weight", "3.lin.bias", "4.lin.weight", "4.lin.bias"]
    assert len(stage.blocks()) == 2


def test_a_missing_side_input_in_the_batch_names_the_block():
    inputs = batch()
    del inputs["scale"]
    with pytest.raises(BrigadeError, match=r"^block 2 \(Pair\) declares side input 'scale' but the batch "
                                           r"has only \['mask', 'tokens'\]"):
        side_inputs.split_inputs(inputs, [Embed(), Masked(), Pair()])


def test_inputs_that_are_not_a_dict_while_blocks_declare_side_inputs():
    with pytest.raises(BrigadeError, match=r"^block 1 \(Masked\) declares side input 'mask' but batch\(\) "
                                           r"returned Tensor\(2\) int64 as inputs"):
        side_inputs.split_inputs(torch.ones(2, dtype=torch.long), [Embed(), Masked()])


def test_an_undeclared_key_makes_the_main_input_ambiguous():
    inputs = {**batch(), "position_ids": torch.zeros(3, 5)}
    with pytest.raises(BrigadeError, match=r"inputs \['tokens', 'position_ids'\] are declared by no block"):
        side_inputs.split_inputs(inputs, [Embed(), Masked(), Pair()])


def test_no_main_input_left():
    with pytest.raises(BrigadeError, match=r"every input of the batch \(\['mask'\]\) is a side input"):
        side_inputs.split_inputs({"mask": torch.ones(1)}, [Masked()])


class BadDeclaration(nn.Module):
    side_inputs = "mask"

    def forward(self, x, *, mask):
        return x


class NoKeyword(nn.Module):
    side_inputs = ("mask",)

    def forward(self, x):
        return x


@pytest.mark.parametrize("block,message", [
    (BadDeclaration(), r"block 0 \(BadDeclaration\).side_inputs = 'mask': expected a tuple of names, "
                       r"e.g. \('mask',\)"),
    (NoKeyword(), r"block 0 \(NoKeyword\) declares side input 'mask' but its forward does not take it by "
                  r"keyword: write forward\(self, x, \*, mask\)"),
])
def test_malformed_declarations(block, message):
    with pytest.raises(BrigadeError, match=message):
        StageModule([block])


def test_a_side_input_not_delivered_names_block_and_stage():
    stage = StageModule([Masked()], indices=[5], stage=2)
    with pytest.raises(BrigadeError, match=r"^stage 2: block 5 \(Masked\) needs side input 'mask', which "
                                           r"was not delivered"):
        stage(torch.ones(1, 2, 4), {})


class Unsendable(nn.Module):
    def forward(self, x):
        return (x, (i for i in range(3)))


def test_an_unsendable_output_names_block_and_stage():
    stage = StageModule([nn.Identity(), Unsendable()], indices=[6, 7], stage=3)
    with pytest.raises(StructureError, match=r"^stage 3: block 7 \(Unsendable\)'s output\[1\] is a "
                                             r"builtins.generator, which cannot be sent"):
        stage(torch.ones(2))


@pytest.mark.parametrize("blocks,indices,message", [
    ([Pair(), TakesDict(), Masked()], [2, 3, 4],
     r"^stage 1: block 4 \(Masked\) failed on block 3 \(TakesDict\)'s output, Tensor\(3, 5, 3\) float32: "
     r"RuntimeError: .*make the blocks agree"),
    ([TakesDict()], [3],
     r"^stage 1: block 3 \(TakesDict\) failed on block 2's output \(previous stage\), Tensor\(3, 5, 4\) "
     r"float32: AttributeError"),
    ([Embed()], [0], r"^stage 1: block 0 \(Embed\) failed on the batch's input, Tensor\(3, 5, 4\)"),
])
def test_a_block_that_cannot_take_the_previous_output(blocks, indices, message):
    stage = StageModule(blocks, indices=indices, stage=1)
    x = torch.ones(3, 5, 4)
    extra = {"mask": torch.ones(3, 5), "scale": torch.tensor(1.0)}
    if isinstance(blocks[0], Pair):
        x = torch.ones(3, 5, 3)  # Masked's Linear(4, 4) then gets 3 features
    with pytest.raises(StructureError, match=message) as err:
        stage(x, extra)
    assert "\n" not in str(err.value)
