import threading

import pytest
import torch

from brigade.errors import RunError
from brigade.pipeline.transport import LocalTransport, decode_header, encode_header


@pytest.mark.parametrize("t", [torch.zeros(3, 5), torch.zeros(2, 1, 4, dtype=torch.int64),
                               torch.zeros((), dtype=torch.bfloat16), torch.zeros(0, 7)])
def test_header_round_trip(t):
    dtype, shape = decode_header(encode_header(t))
    assert dtype == t.dtype and shape == tuple(t.shape)


def test_header_rejects_too_many_dims():
    with pytest.raises(ValueError, match="at most 8 dims"):
        encode_header(torch.zeros([1] * 9))


def test_local_hand_off_keeps_order_and_values():
    hub = LocalTransport([torch.device("cpu")] * 2)
    a, b = hub.endpoint(0), hub.endpoint(1)
    for i in range(3):
        a.send(torch.full((2,), float(i)), 1)
    assert [b.recv(0)[0].item() for _ in range(3)] == [0.0, 1.0, 2.0]


def test_local_recv_gives_up_when_another_stage_fails():
    hub = LocalTransport([torch.device("cpu")] * 2)
    threading.Timer(0.1, hub.abort.set).start()
    with pytest.raises(RunError, match="another stage failed"):
        hub.endpoint(1).recv(0)


def test_local_recv_times_out():
    hub = LocalTransport([torch.device("cpu")] * 2, timeout_s=0.2)
    with pytest.raises(RunError, match="nothing from stage 0"):
        hub.endpoint(1).recv(0)
