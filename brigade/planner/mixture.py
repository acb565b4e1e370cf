"""What a mixture of experts (`models.moe.MoE`) does to the plan, and what expert parallel (`--ep`,
`parallel.experts`) costs. Read from the blocks, on the meta device or real weights alike:

    ids        per block, the ids of its experts' stacked weights (each `GroupedExperts`' own):
               the bytes `ModelCosts.param_bytes` divides by ep, and under sharding by dp
               (1/ep held by each process of an expert group, then sharded over its edp = dp/ep)
    counts     every MoE layer's expert count: the ep degrees the layout space tries divide them
               (`space.ep_sizes`)
    layers     per block, its MoE layers: each issues, per micro-batch, two all-to-alls of rows in
               its forward (tokens to their experts, outputs back) and two in its backward (the
               reverse), and one of the experts' row counts (E numbers) in its forward
    rows       per block and sample, the elements one such all-to-all moves from each process:
               Σ over its layers of tokens × top_k × C (every token of a sample reaches every
               layer: a language model's blocks, (B, T, C))
    total      parameters (a tied one once)
    active     the parameters one token runs through: every dense one (embedding, attention,
               router, a shared expert, the head) and top_k ÷ E of each layer's experts

and two things the meta device needs to cost an MoE forward from shapes (`planner.formula`): the
FLOPs of `torch._grouped_mm` (the experts' grouped matmuls, which torch's FLOP counter does not
know: it would count an MoE's experts as nothing), and `OnMeta`, which lets the routing run there.

The FLOPs counted are those that run: top_k experts a token, as many rows as the router sends
(`flop_counter`). From shapes the rows split evenly over the experts; measured, as the router
chose; the count is the same, only the split differs. Balanced routing is the planner's
assumption throughout: each process of an expert group computes, holds and sends what its own
tokens chose (an imbalanced router's busiest process does more; not counted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from brigade.errors import BrigadeError

_aten = torch.ops.aten
GROUPED_MM = getattr(_aten, "_grouped_mm", None)


@dataclass(frozen=True)
class Mixture:
    """A model's mixture-of-experts facts (module docstring)."""

    ids: tuple[frozenset[int], ...]
    counts: tuple[int, ...]
    layers: tuple[int, ...]
    rows: tuple[float, ...]
    total: int
    active: float
    top_k: tuple[int, ...] = ()  # every MoE layer's experts a token goes to

    def describe(self) -> dict:
        """What a plan reports of the model (`planner.run.plan`): parameter counts, experts."""
        return {"total": self.total, "active": self.active, "moe_layers": sum(self.layers),
                "experts": sorted(set(self.counts)), "top_k": sorted(set(self.top_k))}


def mixture(blocks, tokens: int) -> Mixture | None:
    """The `Mixture` of `blocks` (None: no MoE layer), `tokens` the tokens of one sample."""
    from brigade.parallel.experts import layers

    per = [layers([b]) for b in blocks]
    if not any(per):
        return None
    unique = {id(p): p for b in blocks for p in b.parameters()}
    total = sum(p.numel() for p in unique.values())
    idle = sum(sum(p.numel() for p in m.experts.parameters()) * (1 - m.cfg.top_k / m.cfg.experts)
               for ms in per for m in ms)
    rows = [sum(tokens * m.cfg.top_k * m.gate.in_features for m in ms) for ms in per]
    ids = [frozenset(id(p) for m in ms for p in m.experts.parameters()) for ms in per]
    return Mixture(tuple(ids), tuple(m.cfg.experts for ms in per for m in ms), tuple(map(len, per)),
                   tuple(map(float, rows)), total, total - idle, tuple(m.cfg.top_k for ms in per for m in ms))


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

