"""What a run's mixture-of-experts layers did each step, for its metrics (`models.moe`).

Each layer adds up what its training forwards saw (`MoE.take_seen`: the choices per expert, the
balancing loss and the router's entropy, as sums). Once a step every process puts its layers'
sums in one table, a row a layer of the whole model (zeros for the layers another pipeline
rank holds), and one all-reduce over every process adds the replicas' and the stages' rows
together: every process then knows every layer's step. The record gets

    moe_aux        the balancing loss, the mean over layers of each one's sequence mean
    moe_entropy    the router's entropy (nats), the mean over layers of each one's token mean
    moe_imbalance  the busiest expert's choices over the mean expert's, the worst layer's
                   (1: perfectly even)
    moe_load       per layer, each expert's share of the choices (a list of lists: metrics.jsonl
                   and the plot read it; TensorBoard takes the three figures above)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from brigade.models.moe import MoE


class ExpertStats:
    """Every MoE layer of `blocks` (the whole model: the same list on every process), by block
    index and submodule name."""

    def __init__(self, blocks: list[nn.Module]):
        self.layers = [(i, name, m.cfg.experts) for i, b in enumerate(blocks)
                       for name, m in b.named_modules() if isinstance(m, MoE)]
        self.width = max((e for *_, e in self.layers), default=0)

    def __bool__(self) -> bool:
        return bool(self.layers)

    def record(self, held: dict[int, nn.Module], device: torch.device) -> dict:
        """This step's figures (module docstring), from the layers in `held` (this process's blocks
        by index) and, through one all-reduce, every other process's."""
        e = self.width
        table = torch.zeros(len(self.layers), e + 4, dtype=torch.float64, device=device)
        for k, (i, name, n) in enumerate(self.layers):
            if i in held:
                seen = held[i].get_submodule(name).take_seen().to(device)
                table[k, :n], table[k, e:] = seen[:n], seen[n:]
        dist.all_reduce(table)
        load, (aux, seqs, entropy, rows) = table[:, :e], table[:, e:].T
        shares = load / load.sum(1, keepdim=True).clamp_min(1)
        means = torch.tensor([n for *_, n in self.layers], dtype=torch.float64, device=device)
        imbalance = (load.max(1).values / (load.sum(1) / means).clamp_min(1e-12)).max()
        means = [(aux / seqs.clamp_min(1)).mean(), (entropy / rows.clamp_min(1)).mean(), imbalance]
        a, h, i = torch.stack(means).tolist()
        load = [[round(x, 5) for x in row[:n]] for row, (*_, n) in zip(shares.tolist(), self.layers)]
        return {"moe_aux": a, "moe_entropy": h, "moe_imbalance": i, "moe_load": load}
