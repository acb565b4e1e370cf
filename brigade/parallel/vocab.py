"""The loss of logits split along the vocabulary: torch's loss parallel, around any loss function.

Under tensor parallel a head whose plan says "vocab" (`parallel.tensor`) leaves its logits split
over the tp processes: a DTensor, (B, T, V/tp) on each, sharded on its last dimension. torch's
`loss_parallel` computes a cross-entropy of such logits without gathering them (each process
takes the log-sum-exp of its slice, one all-reduce of a (B, T) max and sum, and the target's logit
from whichever process holds it), and its backward gives each process its slice of the gradient.
It asks for both the loss and its backward to run inside its context, which changes how DTensor
dispatches those ops everywhere in the process.

`split_loss(loss_fn)` keeps that context to the loss alone. The pipeline calls it as it calls any
loss function and runs its backward wherever its schedule says (a whole B, or an I before its W),
outside any context: the loss is an autograd function whose forward builds the loss's own graph
under loss parallel, on a detached copy of the logits, and whose backward runs that graph under
loss parallel again and hands the logits their split gradient.

    logits (DTensor, V/tp) ─► detach ─► loss_fn under loss_parallel ─► loss (replicated) ─► local
    backward:  grad of loss ─► autograd.grad under loss_parallel ─► grad of logits (V/tp)

Anything else (plain logits: a head kept whole, tp 1) goes to `loss_fn` as it is. The loss
function is the model's own (`F.cross_entropy` of the flattened logits, targets as class indices,
an ignore index allowed: what loss parallel supports); one that does something else with split
logits fails in DTensor with torch's message.
"""

from __future__ import annotations

import torch


def split_loss(loss_fn):
    """`loss_fn`, made to take logits split along the vocabulary (module docstring)."""
    def loss(y, target):
        from torch.distributed.tensor import DTensor

        if not isinstance(y, DTensor):
            return loss_fn(y, target)
        return _SplitLoss.apply(y, target, loss_fn)
    loss.__wrapped__ = loss_fn
    return loss


class _SplitLoss(torch.autograd.Function):
    """The loss of split logits as one autograd node (module docstring)."""

    @staticmethod
    def forward(ctx, logits, target, loss_fn):
        from torch.distributed.tensor.parallel import loss_parallel

        with torch.enable_grad(), loss_parallel():  # (a forward under no_grad: no graph to keep)
            leaf = logits.detach().requires_grad_(logits.requires_grad)
            loss = loss_fn(leaf, target)
        ctx.leaf, ctx.loss = leaf, loss
        return loss.to_local().detach()

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel

        loss = ctx.loss
        with loss_parallel():
            g = DTensor.from_local(grad, loss.device_mesh, loss.placements, run_check=False)
            (dlogits,) = torch.autograd.grad(loss, ctx.leaf, g)
        ctx.leaf = ctx.loss = None  # the loss's graph goes with the step's
        return dlogits, None, None
