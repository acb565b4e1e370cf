"""GradientReducer without processes: bucket layout, launch order, the mean written back."""

import pytest
import torch

from brigade.pipeline.runtime import reduce
from brigade.pipeline.runtime.reduce import GradientReducer, _buckets


def test_buckets_reverse_order_cap_and_dtype():
    a, b, c = torch.zeros(4), torch.zeros(4), torch.zeros(2, dtype=torch.float64)
    big = torch.zeros(100)
    assert _buckets([a, b], cap=32) == [[a, b]]
    assert _buckets([a, b], cap=31) == [[a], [b]]
    assert _buckets([a, c, b], cap=1000) == [[a], [c], [b]]  # dtype change starts a bucket
    assert _buckets([big, a], cap=16) == [[big], [a]]  # an oversized parameter has its own


class _Work:
    def __init__(self, flat, log):
        self.flat, self.log = flat, log

    def wait(self):
        self.flat.mul_(2)  # two replicas holding the same gradient: the sum is twice it
        self.log.append("wait")


@pytest.fixture
def launched(monkeypatch):
    log: list = []
    monkeypatch.setattr(reduce.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(reduce.dist, "all_reduce", lambda t, group=None, async_op=False:
                        log.append(t.numel()) or _Work(t, log))
    return log


def test_buckets_start_in_order_once_complete(launched):
    first, second, third = (torch.ones(n, requires_grad=True) for n in (1, 2, 3))
    for p in (first, second, third):
        p.grad = torch.full_like(p, 3.0)
    reducer = GradientReducer([first, second, third], group=None, bucket_bytes=4)
    assert [len(b) for b in reducer.buckets] == [1, 1, 1]  # third, second, first
    reducer.ready([second])
    assert launched == []  # bucket 1 is full, but bucket 0 (third) has not started
    reducer.ready([third])
    assert launched == [3, 2]
    reducer.finish()  # first never reported (unused this step): started here
    assert launched == [3, 2, 1, "wait", "wait", "wait"]
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in (first, second, third))


def test_unused_parameter_keeps_no_gradient(launched):
    used, unused = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    used.grad = torch.ones(2)
    reducer = GradientReducer([used, unused], group=None)
    reducer.ready([used])
    reducer.finish()
    assert unused.grad is None and torch.equal(used.grad, torch.ones(2))
    assert launched == [4, "wait"]  # one bucket, started by finish()
