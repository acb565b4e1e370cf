"""Counting a model's FLOPs on the meta device: torch's FLOP counter with what it does not know.

A model built on the meta device (shapes, no storage) runs its forward and backward there once,
under `flop_counter()`, to count its FLOPs: the planner's costs from shapes (`planner.formula`)
and a run's MFU (`train.mfu`) are counted so. Two things a mixture of experts (`models.moe`)
needs there: the FLOPs of `torch._grouped_mm` (the experts' grouped matmuls, which torch's FLOP
counter does not know: it would count an MoE's experts as nothing), and `OnMeta`, which lets the
routing run on the meta device. The FLOPs counted are those that run: top_k experts a token, as
many rows as the router sends; from shapes the rows split evenly over the experts.
"""

from __future__ import annotations

import copy
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from brigade.errors import BrigadeError

_aten = torch.ops.aten
GROUPED_MM = getattr(_aten, "_grouped_mm", None)


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of `torch._grouped_mm(a, b, offs)`: each group's matmul, summed. Two 2-D operands
    (a weight's gradient) split the contracted dimension between the groups, so every row of a
    meets every column of b once; otherwise each output element is one dot product along a's last
    dimension (2-D × 3-D: the experts' forward and input gradient; 3-D × 3-D: a batched matmul)."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * a_shape[-1] * math.prod(out_shape)


def flop_counter() -> FlopCounterMode:
    """torch's FLOP counter, the experts' grouped matmuls counted too (module docstring)."""
    extra = {GROUPED_MM: _grouped_mm_flops} if GROUPED_MM is not None else {}
    return FlopCounterMode(display=False, custom_mapping=extra)


class OnMeta(TorchDispatchMode):
    """An MoE forward and backward on the meta device, inside this mode: `bincount` (the rows per
    expert, whose values a meta tensor does not have) gives one count per expert, and the grouped
    matmul, whose meta kernel takes bf16 alone, runs its shapes in bf16 and returns the dtype it
    was given. Only shapes matter there: the FLOPs and the bytes saved are the rows', whatever
    their split between experts. Everything else runs as it is."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        meta = any(isinstance(a, torch.Tensor) and a.is_meta for a in args)
        if meta and func is _aten.bincount.default:
            size = max(kwargs.get("minlength", args[2] if len(args) > 2 else 0), 1)
            return torch.empty(size, dtype=torch.int64, device="meta")
        if meta and GROUPED_MM is not None and func.overloadpacket is GROUPED_MM:
            a, b = args[:2]
            half = [t.to(torch.bfloat16) if t.is_floating_point() else t for t in (a, b)]
            return func(*half, *args[2:], **kwargs).to(a.dtype)
        if meta and func is _aten._local_scalar_dense.default:
            raise BrigadeError("an MoE layer read its routing's values on the meta device (its one-matmul-"
                               "an-expert path): costing it from shapes needs torch._grouped_mm (torch "
                               "≥ 2.8, rows of a multiple of 16 bytes); plan it with --costs measured")
        return func(*args, **kwargs)


def model_flops(blocks, x, y, loss_fn) -> float:
    """Forward and backward FLOPs of `blocks` in a chain on the meta batch x, y, the loss
    included: each block run on the one before's output, as a pipeline runs them. Each runs as a
    copy of itself whose parameters and buffers are meta stand-ins (`_meta_copy`): nothing is
    computed or initialised, no weight is copied, and whatever a block keeps from a forward (a
    mixture of experts' routing counts) stays in the copy. `blocks` are callable as `block(h)`
    (a caller binds side inputs first: `pipeline.batches.sample.runnable`)."""
    total, h = 0.0, x
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        inp = h.detach().requires_grad_(h.is_floating_point() and i > 0)
        stand_in = _meta_copy(block)
        with OnMeta(), flop_counter() as counter:
            out = stand_in(inp)
            loss = loss_fn(out, y) if last else out
            torch.autograd.backward(loss, None if last else torch.ones_like(loss))
        total += counter.get_total_flops()
        h = out.detach()
    return float(total)


def _meta_copy(block):
    """A deep copy of `block` with every parameter and buffer a meta tensor of its shape (a
    weight shared inside it, one stand-in): the copy's other state is the block's, copied."""
    memo: dict = {}
    for t in [*block.parameters(), *block.buffers()]:
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = torch.nn.Parameter(meta, t.requires_grad) if isinstance(t, torch.nn.Parameter) else meta
    return copy.deepcopy(block, memo)
