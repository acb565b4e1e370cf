"""Backward across a stage boundary: what the receiver differentiates and what it sends back.

The receiver calls `as_inputs` on what arrived (floating leaves become leaves that require a
gradient, integer ones pass), runs its blocks, then sends `input_grads` back (None for
integer tensors); the sender passes `backward_pairs(outputs, grads)` to
torch.autograd.backward, which keeps only the (output, gradient) pairs autograd needs and
refuses gradients that do not match the outputs in structure, number or shape.
"""

from __future__ import annotations

from typing import Any

import torch

from brigade.pipeline.stages.structure import Spec, StructureError, child_path, describe, flatten, unflatten


def as_inputs(obj: Any) -> Any:
    """A received structure ready for a stage: tensors detached, floating ones requiring a gradient."""
    tensors, spec = flatten(obj, root="input")
    fresh = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
    return unflatten(fresh, spec)


def input_grads(inputs: Any) -> Any:
    """The gradient to send back: `inputs` with each tensor replaced by its .grad (None when none)."""
    tensors, spec = flatten(inputs, root="input")
    return unflatten([t.grad if t.is_floating_point() else None for t in tensors], spec)


def grad_leaves(grads: Any, spec: Spec, root: str = "grad", _out: list | None = None
                ) -> list[torch.Tensor | None]:
    """The gradient at each tensor slot of `spec`, read from a structure shaped like it.

    `grads` has a tensor or None where `spec` has a tensor; its value leaves are not compared.

    Raises:
        StructureError: `grads` does not have the containers `spec` describes.
    """
    out: list = [] if _out is None else _out
    kinds = {"tuple": tuple, "namedtuple": tuple, "list": list, "dict": dict}
    if spec.kind == "T":
        if grads is not None and not isinstance(grads, torch.Tensor):
            raise StructureError(f"{root} is a {type(grads).__name__}: expected a gradient tensor or None")
        out.append(grads)
    elif spec.kind in kinds:
        if not isinstance(grads, kinds[spec.kind]) or len(grads) != len(spec.children) or (
                spec.kind == "dict" and tuple(grads) != spec.keys):
            raise StructureError(f"{root} is {describe(grads)}, expected a {spec.kind} of "
                                 f"{len(spec.children)} like the output: send back input_grads() "
                                 "of the received structure")
        values = grads.values() if spec.kind == "dict" else grads
        for i, (child, value) in enumerate(zip(spec.children, values)):
            grad_leaves(value, child, child_path(root, spec.kind, spec.keys[i] if spec.keys else i), out)
    return out


def select_pairs(outputs: list[torch.Tensor], grads: list[torch.Tensor | None]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Keep the (output, gradient) pairs autograd needs: floating outputs that require a gradient
    and received one. An empty result means nothing flows back (skip the backward call).

    Args:
        outputs: flatten(outputs)[0] of what the stage sent.
        grads: one gradient or None per output tensor, in the same order.

    Raises:
        StructureError: the gradients do not match the outputs in number or shape.
    """
    if len(grads) != len(outputs):
        raise StructureError(f"got {len(grads)} gradients for {len(outputs)} output tensors: "
                             "send one per tensor (None where there is none)")
    keep_t, keep_g = [], []
    for i, (t, g) in enumerate(zip(outputs, grads)):
        if g is None or not (t.is_floating_point() and t.requires_grad):
            continue
        if g.shape != t.shape:
            raise StructureError(f"the gradient of output tensor {i} has shape {tuple(g.shape)}, "
                                 f"expected {tuple(t.shape)}: send the gradient of what was received")
        keep_t.append(t)
        keep_g.append(g)
    return keep_t, keep_g


def backward_pairs(outputs: Any, grads: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`select_pairs` for structures: `grads` is shaped like `outputs` (None where no gradient),
    as `input_grads` on the receiving side makes it.

    Raises:
        StructureError: the gradients do not match the outputs in structure, number or shape.
    """
    outs, spec = flatten(outputs)
    return select_pairs(outs, grad_leaves(grads, spec))
