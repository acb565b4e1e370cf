"""`pipeline.batches.sample`: a batch's first rows whatever its shape, and blocks bound to their side inputs,
so the planner runs each block as the pipeline's feed would hand it its inputs."""

import pytest
import torch
from torch import nn

from brigade import unbatched
from brigade.errors import BrigadeError
from brigade.pipeline.batches.sample import Bound, runnable, take


class Masked(nn.Module):
    side_inputs = ("mask",)

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, *, mask):
        return self.lin(x) * mask[..., None]


def test_take_cuts_every_batched_tensor_and_keeps_the_rest_whole():
    batch = {"x": torch.arange(12.).view(6, 2), "mask": torch.ones(6, dtype=torch.bool),
             "scale": torch.tensor(2.0), "table": unbatched(torch.zeros(3, 3))}
    got = take(batch, 2)
    assert got["x"].tolist() == [[0., 1.], [2., 3.]] and got["mask"].shape == (2,)
    assert got["scale"].dim() == 0 and got["table"].shape == (3, 3)  # whole, unwrapped
    assert take(torch.arange(5), 3).tolist() == [0, 1, 2]


def test_a_block_that_declares_side_inputs_is_bound_to_them():
    blocks = [nn.Linear(4, 4), Masked()]
    x, mask = torch.randn(3, 4), torch.tensor([1., 0., 1.])
    main, bound = runnable(blocks, {"input": x, "mask": mask})
    assert main is x and bound[0] is blocks[0] and isinstance(bound[1], Bound)
    assert list(bound[1].parameters())[0] is blocks[1].lin.weight  # the block's own, not a copy
    torch.testing.assert_close(bound[1](bound[0](main)), blocks[1](blocks[0](x), mask=mask))


def test_a_batch_without_a_declared_side_input_is_refused_in_one_line():
    with pytest.raises(BrigadeError, match=r"^block 1 \(Masked\) declares side input 'mask' but the "
                                           r"batch has only \['input'\]"):
        runnable([nn.Linear(4, 4), Masked()], {"input": torch.randn(2, 4)})
