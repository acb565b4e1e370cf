"""The split backward (I now, W later) against one autograd backward: the same gradients."""

import pytest
import torch

from brigade.pipeline.runtime import backward


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
