"""P2P message bookkeeping: layouts, meta headers and descriptions round-trip."""

import pytest
import torch

from brigade.pipeline.stages import structure
from brigade.pipeline.transport import message


@pytest.mark.parametrize("obj", [
    torch.zeros(2, 3),
    {"h": torch.zeros(2, 3), "ids": torch.arange(2), "n": 3, "mask": None},
    (torch.zeros(1, dtype=torch.float64), [torch.ones(2, 2, dtype=torch.bool), 0.5]),
])
def test_what_the_receiver_reads_is_the_layout_sent(obj):
    tensors, layout = message.layout_of(obj)
    got = message.read_meta(message.meta(layout))
    if message.plain(layout):
        assert got == layout
    else:
        assert got == len(message.describe(layout))
        assert message.read_description(message.describe(layout)) == layout
    assert message.read_meta(message.meta(layout, same=True)) is None
    assert len(message.meta(layout)) == message.META_LEN
    rebuilt = message.build(message.buffers(layout, torch.device("cpu"), zeros=True), layout)
    assert message.key_of(rebuilt) == layout


def test_a_damaged_description_is_refused():
    _, layout = message.layout_of((torch.zeros(2), torch.zeros(3)))
    with pytest.raises(structure.StructureError, match="lists 1 tensors for 2 slots"):
        message.read_description(message.describe(layout)[:-message.HEADER_LEN])
