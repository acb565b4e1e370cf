"""The wire format: tensor headers and structure descriptions as int64s, round trip and refusals."""

import pytest
import torch

from brigade.pipeline.stages.structure import StructureError, flatten
from brigade.pipeline.transport import wire
from brigade.pipeline.transport.wire import decode_header, encode_header
from tests.pipeline.stages.test_structure import nested


@pytest.mark.parametrize("obj", [nested(), torch.zeros(1), (), {"a": []}, ("é€😀", -(2**63), 2**63 - 1),
                                 [1.5e-300, float("inf"), None]])
def test_encode_decode_round_trip(obj):
    spec = flatten(obj)[1]
    codes = wire.encode(spec)
    assert all(isinstance(c, int) and -(2**63) <= c < 2**63 for c in codes)
    torch.tensor(codes, dtype=torch.int64)  # a transport sends it as one int64 tensor
    assert wire.decode(codes) == spec
    assert wire.decode(torch.tensor(codes).tolist()) == spec


def test_decode_refuses_damaged_or_foreign_descriptions():
    codes = wire.encode(flatten(nested())[1])
    with pytest.raises(StructureError, match="version"):
        wire.decode([99, *codes[1:]])
    with pytest.raises(StructureError, match="damaged"):
        wire.decode(codes[:-3])
    with pytest.raises(StructureError, match="damaged"):
        wire.decode([*codes, 0])


def test_encode_refuses_an_int_beyond_64_bits():
    with pytest.raises(StructureError, match="does not fit in 64 bits"):
        wire.encode(flatten([2**70])[1])


@pytest.mark.parametrize("t", [torch.zeros(3, 5), torch.zeros(2, 1, 4, dtype=torch.int64),
                               torch.zeros((), dtype=torch.bfloat16), torch.zeros(0, 7)])
def test_header_round_trip(t):
    dtype, shape = decode_header(encode_header(t))
    assert dtype == t.dtype and shape == tuple(t.shape)


def test_header_rejects_too_many_dims():
    with pytest.raises(ValueError, match="at most 8 dims"):
        encode_header(torch.zeros([1] * 9))
