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

and the FLOPs an MoE's forward runs, counted on the meta device by `models.flops` (its grouped
matmuls, and `OnMeta`, which lets the routing run there): top_k experts a token, as many rows
as the router sends. From shapes the rows split evenly over the experts; measured, as the router
chose; the count is the same, only the split differs. Balanced routing is the planner's
assumption throughout: each process of an expert group computes, holds and sends what its own
tokens chose (an imbalanced router's busiest process does more; not counted).
"""

from __future__ import annotations

from dataclasses import dataclass


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


