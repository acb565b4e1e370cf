"""Backward across a stage boundary: inputs that take a gradient, the gradient sent back, the pairs
autograd gets, and gradients that do not match the outputs refused."""

import pytest
import torch

from brigade.pipeline.stages import boundary
from brigade.pipeline.stages.structure import StructureError, flatten


def test_gradients_flow_back_through_a_structure():
    """What a boundary does: receive, require grads, run, send input_grads back, backward."""
    w = torch.randn(3, requires_grad=True)
    ids = torch.tensor([[0, 2]])
    sent = {"h": torch.randn(1, 3) * w, "ids": ids, "n": 2, "unused": torch.randn(1, 3) * w}
    received = boundary.as_inputs(sent)
    assert received["h"].requires_grad and received["h"].is_leaf and not received["ids"].requires_grad
    (received["h"] * received["ids"].sum()).sum().backward()
    grads = boundary.input_grads(received)
    assert grads["ids"] is None and grads["unused"] is None and grads["n"] == 2
    outs, gs = boundary.backward_pairs(sent, grads)
    assert len(outs) == 1 and outs[0] is sent["h"]
    torch.autograd.backward(outs, gs)
    assert torch.allclose(w.grad, (2 * sent["h"].detach() / w.detach()).sum(0))


def test_encoded_grads_travel_as_a_flat_list():
    sent = (torch.ones(2, requires_grad=True) * 2, torch.arange(2))
    outs, spec = flatten(sent)
    flat = boundary.grad_leaves((torch.ones(2), None), spec)
    assert len(flat) == 2 and flat[1] is None
    kept, grads = boundary.select_pairs(outs, flat)
    assert kept == [sent[0]] and torch.equal(grads[0], torch.ones(2))


def test_nothing_to_send_back_is_an_empty_pair():
    assert boundary.backward_pairs((torch.ones(2), 3), (None, 3)) == ([], [])


@pytest.mark.parametrize("grads,message", [
    ((torch.ones(2),), r"grad is tuple\(Tensor\(2\) float32\), expected a tuple of 2"),
    ((torch.ones(2), "x"), r"grad\[1\] is a str: expected a gradient tensor or None"),
    ((torch.ones(3), None), r"gradient of output tensor 0 has shape \(3,\), expected \(2,\)"),
])
def test_mismatched_gradients_are_refused(grads, message):
    sent = (torch.ones(2, requires_grad=True) * 2, torch.ones(2, requires_grad=True) * 3)
    with pytest.raises(StructureError, match=message):
        boundary.backward_pairs(sent, grads)


def test_select_pairs_checks_the_count():
    with pytest.raises(StructureError, match="got 1 gradients for 2 output tensors"):
        boundary.select_pairs([torch.ones(1), torch.ones(1)], [None])
