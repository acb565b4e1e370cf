"""What context parallel (`--cp`, `parallel.context`) needs to know of a model's attention, and the
cp degrees a model takes. Observed, not declared: each block's forward runs once on the meta
device (one sample, shapes only) and every call of `F.scaled_dot_product_attention` it makes is
recorded as it reaches the function:

    q (B, H, T, D)   k (B, K, S, D)   v (B, K, S, Dv)   is_causal   attn_mask

so the heads (H), key/value heads (K), head dims and sequence are the ones the runtime's
attention mode (`parallel.context._Attention`) will see, whatever the model: the built-in GPT
(H = K), a Hugging Face family from its config.json alone (grouped-query attention: K < H where
transformers hands SDPA the key/value heads, K = H where it repeats them first), or any block that
calls SDPA. The call is answered with an empty output of the right shape, so nothing is
computed: the Llama 3.1 8B at 131,072 positions is observed in well under a second.

A tensor-parallel plan that declares its heads (`parallel.context.heads_of`) says the same for
the blocks that have one, but not K where a fused projection holds both, nor whether attention
goes through SDPA at all; a block whose attention does not (a hand-written softmax) is invisible
here, and the planner gives such a model cp 1 alone, as it gives a model without attention.

The cp degrees a model takes at tp degree `tp` (`cp_sizes`) are those the runtime accepts
(`parallel.context.check_length`, `check_heads`, the mask refusal): the sequence splits into
cp × tp parts (2 × cp × tp chunks under ring), under all-to-all every call's heads ÷ tp split into
cp groups, and no call passes a mask (a sliding window shorter than the sequence, padding: the
runtime refuses a mask under --cp). The degrees tried are the powers of two from 2 up to a
node's devices ÷ tp (cp × tp in one node: cp sits next to tp in the mesh, so its group then stays
on the node's links, where its all-to-alls and ring steps are cheapest): 2, 4 and 8 on nodes of 8
GPUs whatever their count, which keeps the rows to about twice or three times those without cp.
`brigade plan --cp N` asks for any degree that divides the world, across nodes too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from brigade.errors import BrigadeError
from brigade.models.flops import OnMeta
from brigade.parallel.context import check_heads, check_length

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@dataclass(frozen=True)
class Call:
    """One attention call of a block, per sample: query heads, key/value heads, query length,
    key length, query/key head dim, value head dim; whether causal, whether it passed a mask."""

    heads: int
    kv_heads: int
    length: int
    keys: int
    head_dim: int
    value_dim: int
    causal: bool = True
    masked: bool = False

    def kv_at(self, tp: int, cp: int, ring: bool) -> float:
        """The key/value heads one process of `tp` moves per token under `cp`: its K/tp, or under
        all-to-all, where cp does not divide them, its query heads (the runtime repeats k and v
        to them first, `ContextParallel.attend`)."""
        own = self.kv_heads / tp
        return own if ring or own % cp == 0 else self.heads / tp


@dataclass(frozen=True)
class AttentionFacts:
    """Per block, the attention calls its forward makes (module docstring)."""

    calls: tuple[tuple[Call, ...], ...]

    @property
    def heads(self) -> tuple[int, ...]:
        """Every call's query heads (all-to-all splits each into cp groups)."""
        return tuple(c.heads for block in self.calls for c in block)

    @property
    def masked(self) -> bool:
        return any(c.masked for block in self.calls for c in block)

    def cp_sizes(self, cells: int, tp: int, length: int, ring: bool, tried: tuple[int, ...] = (),
                 most: int = 0) -> tuple[int, ...]:
        """The cp degrees (1 first) a tp process of `tp` takes over `cells` = world ÷ tp ranks:
        `tried` (default: the powers of two up to `most`, a node's devices ÷ tp, or `cells` where
        `most` is 0) that divide `cells` and that the runtime would accept at sequence `length`
        (module docstring)."""
        most = min(most or cells, cells)
        tried = tried or tuple(1 << k for k in range(1, most.bit_length()) if 1 << k <= most)
        ok = [cp for cp in tried if cp > 1 and cells % cp == 0 and self.refusal(cp, tp, length, ring) is None]
        return (1, *ok)

    def refusal(self, cp: int, tp: int, length: int, ring: bool, model: str = "the model") -> str | None:
        """Why the runtime would refuse `cp` at tp `tp` and sequence `length` (one line), or None."""
        method = "ring" if ring else "all-to-all"
        try:
            check_length(length, cp, tp, method, what="--seq-len")
            if not ring:
                for h in sorted(set(self.heads)):
                    check_heads(h, h, cp, tp, where=model)
        except BrigadeError as exc:
            return str(exc)
        if self.masked:
            return (f"--cp {cp}: {model} calls attention with a mask (a sliding window shorter than the "
                    "sequence, or padding), which context parallel refuses; plan a sequence no longer than "
                    "the window, or drop --cp")
        return None


class _Observe(TorchFunctionMode):
    """Records each `F.scaled_dot_product_attention` call and answers it with an empty output."""

    def __init__(self):
        super().__init__()
        self.calls: list[Call] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        given = {**dict(zip(_SDPA_ARGS, args)), **kwargs}
        q, k, v = given["query"], given["key"], given["value"]
        self.calls.append(Call(q.shape[-3], k.shape[-3], q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1],
                               bool(given.get("is_causal")), given.get("attn_mask") is not None))
        return q.new_empty((*q.shape[:-1], v.shape[-1]))


def attention(blocks, x) -> AttentionFacts | None:
    """The `AttentionFacts` of `blocks` (as `sample.runnable` binds them) run on the meta batch `x`
    (one sample); None where no block calls SDPA. A mixture of experts' routing runs there inside
    `models.flops.OnMeta`."""
    per: list[tuple[Call, ...]] = []
    h = x
    with torch.no_grad(), OnMeta():
        for block in blocks:
            seen = _Observe()
            with seen:
                h = block(h)
            per.append(tuple(seen.calls))
    return AttentionFacts(tuple(per)) if any(per) else None


def observe(spec) -> AttentionFacts | None:
    """`attention` of a model built on the meta device, on a meta batch of one sample."""
    from brigade.pipeline.batches.feed import to
    from brigade.pipeline.batches.sample import runnable

    x, _ = spec.make_batch(1, torch.Generator().manual_seed(0))
    h, blocks = runnable(spec.blocks, to(x, "meta"))
    return attention(blocks, h)
