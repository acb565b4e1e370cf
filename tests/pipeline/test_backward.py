"""GradientReducer without processes: bucket layout, launch order, the mean written back."""

import pytest
import torch

from brigade.pipeline import backward
from brigade.pipeline.backward import GradientReducer, _buckets


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
    monkeypatch.setattr(backward.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(backward.dist, "all_reduce", lambda t, group=None, async_op=False:
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


def _stage(x, ids, w1, w2, w3):
    """Several outputs: one through x, one skip of x, one from the parameters alone."""
    h = torch.tanh(x @ w1)
    return [h @ w2 + x, x * 2, (w3 * 3).sum(0, keepdim=True).expand(2, 3)], ids


@pytest.mark.parametrize("shared", [False, True])
def test_backward_split_over_several_outputs_and_inputs_matches_autograd(shared):
    """Input gradients now, weight gradients later, as one backward computes them; an integer
    input gets None, an input nothing depends on gets None; `shared` forces the unsplit path."""
    torch.manual_seed(0)
    params = [torch.randn(3, 3, requires_grad=True) for _ in range(3)]
    if shared:
        params[1] = params[0]  # one parameter under two frontier nodes: no clean split
    grads = [torch.randn(2, 3) for _ in range(3)]
    x = torch.randn(2, 3)
    ids, unused = torch.tensor([1, 2]), torch.randn(2, 3, requires_grad=True)

    ref_x = x.clone().requires_grad_()
    ref_params = [p.detach().clone().requires_grad_() for p in params]
    if shared:
        ref_params[1] = ref_params[0]
    outs, _ = _stage(ref_x, ids, *ref_params)
    torch.autograd.backward(outs, grads)

    leaf = x.clone().requires_grad_()
    outs, _ = _stage(leaf, ids, *params)
    dxs, weight_step = backward.backward_split(outs, grads, [leaf, ids, unused], list(dict.fromkeys(params)))
    assert dxs[1] is None and dxs[2] is None
    torch.testing.assert_close(dxs[0], ref_x.grad)
    assert shared or all(p.grad is None for p in params), "weight gradients wait for the weight step"
    done = []
    weight_step(done.extend)
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p.grad, q.grad)
    assert {id(p) for p in done} == {id(p) for p in params}


def test_backward_split_single_tensor_keeps_its_contract():
    """One tensor in, one out: dL/dx a tensor, zeros when y does not depend on x."""
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3, requires_grad=True)
    dx, step = backward.backward_split((w * 2).sum(), None, x, [w])
    assert torch.equal(dx, torch.zeros_like(x))
    step()
    assert torch.equal(w.grad, torch.full_like(w, 2.0))
