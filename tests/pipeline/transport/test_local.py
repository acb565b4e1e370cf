"""The in-process hand-off between device threads: order, values, and giving up in time."""

import threading

import pytest
import torch

from brigade.errors import RunError
from brigade.pipeline.plans.action import RECV_F, SEND_F, Action
from brigade.pipeline.transport.local import LocalTransport


def test_local_hand_off_keeps_order_and_values():
    hub = LocalTransport([torch.device("cpu")] * 2)
    a, b = hub.endpoint(), hub.endpoint()
    for i in range(3):
        a.send(Action(0, SEND_F, i), torch.full((2,), float(i)))
    assert [b.recv(Action(1, RECV_F, i))[0].item() for i in range(3)] == [0.0, 1.0, 2.0]


def test_local_recv_gives_up_when_another_stage_fails():
    hub = LocalTransport([torch.device("cpu")] * 2)
    threading.Timer(0.1, hub.abort.set).start()
    with pytest.raises(RunError, match="another stage failed"):
        hub.endpoint().recv(Action(1, RECV_F, 0))


def test_local_recv_times_out():
    hub = LocalTransport([torch.device("cpu")] * 2, timeout_s=0.2)
    with pytest.raises(RunError, match="nothing from stage 0"):
        hub.endpoint().recv(Action(1, RECV_F, 0))
