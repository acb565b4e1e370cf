"""What tensor parallel does to a model's blocks, as the planner needs it: the share of each
block's parameter bytes a tp split divides, the all-reduces it adds, and the degrees it allows.

Read from the blocks' plans (`brigade.parallel.tensor`), on the meta device or real weights alike:

    split    per block: bytes of the planned weights (and a column-wise layer's bias) ÷ all its
             parameter bytes; the rest (norms, a row-wise layer's bias, an empty plan's block)
             stays whole on every tp process
    pairs    per block: its row-wise layers, each one all-reduce of the block's output in the
             forward and one of its input gradient in the backward (the Megatron-LM pattern)
    sizes    the tp degrees every block's plan divides (powers of two); (1,) without plans
    normed   per block under sequence parallel (a plan with "sequence" entries; 0: the block is
             whole or plain tensor parallel): its norms, each of whose outputs one device holds
             once for the matmuls after it
    gathered per such block: the whole copies of the sequence its matmuls hold for their
             backward instead ("gather" entries, and column-wise layers outside one, which
             gather their own input): the rest of what it holds is split by tp
    shared   per such block: those of its copies that "gather" entries make, which a block
             without recompute keeps as parts (`parallel.sequence.save_parts`)
    vocab    per block: the vocabulary a "vocab" entry splits (an untied head), 0 for none: at a
             degree that divides it, the head's logits, and all that comes of them (the loss's
             softmax, their gradient), are 1/tp on each process; at one that does not, the head
             stays whole (`parallel.tensor.plan_at`)
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from brigade.errors import BrigadeError
from brigade.parallel.tensor import STYLES, check_plans, plan_of, style_of

MOST = 64  # the largest degree tried: a node's devices


@dataclass(frozen=True)
class TensorFacts:
    split: tuple[float, ...]
    pairs: tuple[int, ...]
    sizes: tuple[int, ...] = (1,)
    normed: tuple[int, ...] = ()
    gathered: tuple[int, ...] = ()
    shared: tuple[int, ...] = ()
    vocab: tuple[int, ...] = ()

    def whole(self, block: int, tp: int) -> bool:
        """Whether tp leaves the block whole: a head whose vocabulary `tp` does not divide."""
        return bool(self.vocab) and self.vocab[block] > 0 and self.vocab[block] % tp > 0

    def sequence(self, block: int, tp: int = 2) -> bool:
        """Whether the block splits its sequence under tp (sequence parallel)."""
        return bool(self.normed) and self.normed[block] > 0 and not self.whole(block, tp)

    def splits_vocab(self, block: int, tp: int) -> bool:
        """Whether the block's logits are split over `tp` processes (a head's "vocab" entry)."""
        return tp > 1 and bool(self.vocab) and self.vocab[block] > 0 and not self.whole(block, tp)

    def factor(self, block: int, tp: int) -> float:
        """What a block's split work and parameters become at degree `tp`, as a share of tp 1's."""
        s = self.split[block] if tp > 1 and not self.whole(block, tp) else 0.0
        return 1 - s + s / tp


def _split_bytes(block: nn.Module, plan: dict) -> float:
    modules = dict(block.named_modules())
    total = 0
    for name, entry in plan.items():
        module, style = modules[name], style_of(entry)[0]
        if style not in STYLES:  # a norm, a gathered module, a per-head weight: whole
            continue
        for pname, p in module.named_parameters(recurse=False):
            if style != "rowwise" or pname == "weight":  # a row-wise layer's bias stays whole
                total += p.numel() * p.element_size()
    return total


def facts(blocks: list[nn.Module]) -> TensorFacts:
    """The model's `TensorFacts` (module docstring)."""
    if any(plan_of(b) is None for b in blocks):
        return TensorFacts(tuple(0.0 for _ in blocks), tuple(0 for _ in blocks))
    split, pairs, normed, gathered, shared, vocab = [], [], [], [], [], []
    for b in blocks:
        plan = plan_of(b)
        modules = dict(b.named_modules())
        vocab.append(sum(modules[n].out_features for n, e in plan.items() if style_of(e)[0] == "vocab"))
        whole = sum(p.numel() * p.element_size() for p in b.parameters())
        split.append(_split_bytes(b, plan) / whole if whole else 0.0)
        pairs.append(sum(style_of(e)[0] == "rowwise" for e in plan.values()))
        normed.append(sum(e == "sequence" for e in plan.values()))
        gathered.append(_gathered(plan) if normed[-1] else 0)
        shared.append(sum(e == "gather" for e in plan.values()) if normed[-1] else 0)
    sizes = [1]
    t = 2
    while t <= MOST:
        try:
            check_plans(blocks, t)
        except BrigadeError:
            break
        sizes.append(t)
        t *= 2
    return TensorFacts(tuple(split), tuple(pairs), tuple(sizes), tuple(normed), tuple(gathered),
                       tuple(shared), tuple(vocab))


def _gathered(plan: dict) -> int:
    """The whole copies of the sequence a sequence-parallel block's matmuls hold (`gathered`)."""
    gathers = [n for n, e in plan.items() if e == "gather"]
    own = [n for n, e in plan.items() if style_of(e)[0] in ("colwise", "vocab")
           and not any(n.startswith(g + ".") for g in gathers)]
    return len(gathers) + len(own)
