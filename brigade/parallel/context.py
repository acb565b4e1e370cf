"""Context parallel: each sequence of a stage split over the `cp` processes of its "cp" group.

`--cp C` cuts every micro-batch along the sequence (dimension 1 of the tokens, the targets and
every side input of two or more dimensions) before the pipeline sees it, so each process holds
T / C positions of every activation, every saved tensor and every message its pipeline sends.
Everything outside attention works on its part unchanged; attention, the one place where a
position meets every earlier one, exchanges through one of two methods (`--cp-method`):

    all-to-all (Ulysses, DeepSpeed's)   q, k, v (B, H, T/C, D) ─ all-to-all over the cp group ─
                                        (B, H/C, T, D): every position, a C-th of the heads ─
                                        SDPA ─ all-to-all back ─ (B, H, T/C, D). Needs the heads
                                        this process holds (H ÷ tp) divisible by C; key/value
                                        heads that are not are repeated to the query heads
                                        first (grouped-query attention). Runs on CPU and GPU.
    ring                                torch's ring attention (`context_parallel`'s dispatcher
                                        over DTensors Shard(2)): keys and values travel round
                                        the group, queries stay; on CUDA only (torch has no CPU
                                        sharding strategy for its attention kernel).

The cut. All-to-all takes C consecutive parts (rank r: [r·T/C, (r+1)·T/C)). Ring takes the
load-balanced causal split torch's ring attention expects (its head-tail balancer): the
sequence in 2C chunks, rank r holding chunk r and chunk 2C−1−r, so every rank has as much of
the causal triangle to compute.

Positions. A block whose forward takes a `positions` keyword (the GPT's embedding,
examples/llama.py's decoder, a Hugging Face GPT-2 embedding) is handed the global position of
each token of its part ((T/C,), int64), by a forward pre-hook: without --cp it makes its own,
0..T−1. A Hugging Face Llama-like model's rotary (cos, sin) is a side input computed once per
batch over the whole sequence, which the cut leaves right on every part.

The loss. Each process's last stage computes the loss on its part. A part counts by its share
of the counted targets of its micro-batch (targets that are not -100, torch's and transformers'
ignore index; every one where none is): its loss is scaled by C · counted(part) / counted(whole),
so the mean over the cp processes, which the gradients' reduction over dp × cp takes, is the
mean over every counted token of the sequence, for a loss that is a mean over tokens (the
GPT's, the Hugging Face families'). The reported loss is that mean (`mean`).

Attention is found where a held block's forward calls `F.scaled_dot_product_attention`: each such
forward runs under a torch-function mode (`_Attention`) that routes the call through the method.
The mode sits inside the block's forward, so recompute replays it. Only the causal form
(is_causal=True, no mask) and full attention (no mask) pass: an explicit mask was built by the
model from its own part and cannot say what the whole sequence's is; it is refused in one line.

The rules that need no torch (the methods, the lengths and heads that split, what --cp composes
with) are `config.context`'s, which the configuration asks before any process starts; this
module re-exports them, and adds those that read the blocks (`check_model`).
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from brigade.config.context import METHODS, check_heads, check_layout, check_length, method_for
from brigade.errors import BrigadeError

__all__ = ["METHODS", "check_heads", "check_layout", "check_length", "method_for", "ContextParallel", "apply",
           "check_model", "heads_of", "takes_positions"]

IGNORE = -100  # a target the loss skips (torch's cross-entropy's and transformers' ignore index)


def heads_of(blocks: list[nn.Module]) -> int | None:
    """The most attention heads a block declares in its tensor-parallel plan (a ("colwise", heads)
    entry: the query projection's); None where no block declares any."""
    counts = [entry[1] for b in blocks for entry in (getattr(b, "tp_plan", None) or {}).values()
              if isinstance(entry, tuple) and entry[0] == "colwise" and len(entry) > 1]
    return max(counts) if counts else None


def check_model(blocks: list[nn.Module], cp: int, method: str, tp: int, length: int, model: str) -> None:
    """Before a run, what the blocks tell: under all-to-all, heads that C × tp splits (where their
    plans say how many, `heads_of`); no block with a sliding window shorter than the sequence
    (a Hugging Face layer's `window`: its mask is built on a part, and is refused or wrong).

    Raises:
        BrigadeError: one line each.
    """
    if cp == 1:
        return
    heads = heads_of(blocks)
    if heads is not None and method != "ring":
        check_heads(heads, heads, cp, tp, where=model)
    windows = [w for b in blocks if (w := getattr(b, "window", None)) is not None and w < length]
    if windows:
        raise BrigadeError(f"{model} attends within a sliding window of {min(windows)} positions, shorter "
                           f"than the sequence ({length}) under --cp {cp}: context parallel takes causal "
                           "attention without a mask; use a sequence no longer than the window, or drop --cp")


def takes_positions(block: nn.Module) -> bool:
    """Whether `block`'s forward takes a `positions` keyword (module docstring)."""
    p = inspect.signature(block.forward).parameters.get("positions")
    return p is not None and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)


class ContextParallel:
    """This process's part of every sequence, and what it needs to stand for the whole.

    Args:
        group: the cp process group; mesh: its 1-D DeviceMesh (ring's DTensors).
        method: "all-to-all" or "ring" (`method_for`).
    """

    def __init__(self, group, mesh, method: str):
        self.group, self.mesh, self.method = group, mesh, method
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.calls, self.verified = 0, False  # attention calls routed here; `verify` asked once

    def verify(self, device: torch.device) -> None:
        """After the first step: refuse a model whose attention never reached the method (every
        process asks, one all-reduce: a process whose stages hold no attention made none). A
        block that attends by hand (its own softmax) would attend only to its own part.

        Raises:
            BrigadeError: no process routed an attention call.
        """
        if self.verified:
            return
        self.verified = True
        calls = torch.tensor([self.calls], device=device)
        dist.all_reduce(calls, op=dist.ReduceOp.MAX)
        if int(calls.item()) == 0:
            raise BrigadeError(f"--cp {self.size} but no block called F.scaled_dot_product_attention in the "
                               "first step: context parallel routes attention through it, and attention "
                               "computed otherwise would see only its own part; call SDPA, or drop --cp")

    def index(self, length: int, device=None) -> torch.Tensor:
        """The global positions of this process's part of a sequence of `length`: (length / C,)."""
        c, r = self.size, self.rank
        if self.method == "ring":
            n = length // (2 * c)
            return torch.cat([torch.arange(r * n, (r + 1) * n, device=device),
                              torch.arange((2 * c - 1 - r) * n, (2 * c - r) * n, device=device)])
        n = length // c
        return torch.arange(r * n, (r + 1) * n, device=device)

    def cut(self, x: torch.Tensor) -> torch.Tensor:
        """This process's part of `x` along dimension 1 (a tensor of 2 or more dimensions; others
        whole).

        Raises:
            BrigadeError: a sequence the cut does not divide.
        """
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return x
        check_length(x.shape[1], self.size, 1, self.method, what=f"a sequence of {tuple(x.shape)}: length")
        if self.method != "ring":
            n = x.shape[1] // self.size
            return x[:, self.rank * n:(self.rank + 1) * n]
        return x.index_select(1, self.index(x.shape[1], x.device))

    def share(self, targets) -> float:
        """The factor on this part's loss (module docstring): C · counted(part) / counted(whole),
        1 where nothing is ignored; `targets` whole."""
        if not isinstance(targets, torch.Tensor) or targets.dim() < 2:
            return 1.0
        counted = torch.ones_like(targets, dtype=torch.bool) if targets.is_floating_point() else \
            targets != IGNORE
        whole = int(counted.sum())
        return self.size * int(self.cut(counted).sum()) / whole if whole else 1.0

    def mean(self, loss: torch.Tensor) -> torch.Tensor:
        """The parts' losses (each scaled by `share`) → their mean, the sequence's: one all-reduce."""
        dist.all_reduce(loss, group=self.group)
        return loss / self.size

    def attend(self, q, k, v, dropout_p: float = 0.0, is_causal: bool = False, scale=None,
               enable_gqa: bool = False) -> torch.Tensor:
        """SDPA of this process's queries over every key of the sequence, by the method."""
        self.calls += 1
        if self.method == "ring":  # grouped key/value heads repeated: torch's ring takes whole ones
            k, v = (z.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for z in (k, v))
            return _ring(q, k, v, self.mesh, dropout_p, is_causal, scale)
        c = self.size
        if k.shape[1] % c:  # key/value heads that do not split: repeated to the query heads
            k, v = (z.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for z in (k, v))
            enable_gqa = False
        if q.shape[1] % c:
            raise BrigadeError(f"attention with {q.shape[1]} heads on this process under --cp {c}: the "
                               f"all-to-all hands each process a {c}-th of them; use a --cp (× --tp) that "
                               "divides the heads")
        q, k, v = (_heads_to_sequence(z, self.group, c) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                           enable_gqa=enable_gqa)
        return _sequence_to_heads(y, self.group, c)


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(x.contiguous(), None, None, group))


def _heads_to_sequence(x: torch.Tensor, group, c: int) -> torch.Tensor:
    """(B, H, T/C, D), every head of this part → (B, H/C, T, D), every position of a C-th of the
    heads (the r-th on rank r), the parts in rank order."""
    b, h, t, d = x.shape
    send = x.reshape(b, c, h // c, t, d).transpose(0, 1).reshape(c * b, h // c, t, d)
    got = _all_to_all(send, group).view(c, b, h // c, t, d)  # [source part] of my heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * t, d)


def _sequence_to_heads(y: torch.Tensor, group, c: int) -> torch.Tensor:
    """`_heads_to_sequence` undone: (B, H/C, T, D) → (B, H, T/C, D)."""
    b, hc, tt, d = y.shape
    t = tt // c
    send = y.view(b, hc, c, t, d).permute(2, 0, 1, 3, 4).reshape(c * b, hc, t, d)
    got = _all_to_all(send, group).view(c, b, hc, t, d)  # [source's heads] of my part
    return got.transpose(0, 1).reshape(b, c * hc, t, d)


_RING_READY = False


def _ring(q, k, v, mesh, dropout_p, is_causal, scale) -> torch.Tensor:
    """torch's ring attention over the cp mesh, on the load-balanced causal split (CUDA)."""
    global _RING_READY
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental import _attention as ring

    if not _RING_READY:  # DTensor's SDPA dispatched to the ring, the parts in head-tail order
        ring._cp_options.enable_load_balance = True
        ring._enable_context_parallel_dispatcher()
        _RING_READY = True
    q, k, v = (DTensor.from_local(z.contiguous(), mesh, [Shard(2)], run_check=False) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    return y.to_local()


class _Attention(TorchFunctionMode):
    """Routes `F.scaled_dot_product_attention` through a `ContextParallel` (module docstring)."""

    def __init__(self, cp: ContextParallel, where: str):
        super().__init__()
        self.cp, self.where = cp, where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        given = {**dict(zip(names, args)), **kwargs}
        if given.pop("attn_mask", None) is not None:
            raise BrigadeError(f"{self.where} calls attention with a mask under --cp {self.cp.size}: a mask "
                               "built on one part cannot say what the whole sequence's is; context parallel "
                               "takes causal attention (is_causal=True, no mask) or full attention: drop the "
                               "mask (padding at the end of each row needs none), or drop --cp")
        return self.cp.attend(given.pop("query"), given.pop("key"), given.pop("value"), **given)


def _attending(forward, cp: ContextParallel, where: str):
    def run(*args, **kwargs):
        with _Attention(cp, where):
            return forward(*args, **kwargs)
    return run


def _positions(cp: ContextParallel, tp: int):
    """A forward pre-hook (with kwargs) handing a block its part's global positions; `tp`: the
    factor between the block's input and the cp part (sequence parallel's parts), else 1."""
    def hook(module: nn.Module, args: tuple, kwargs: dict):
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or "positions" in kwargs:
            return None
        return args, {**kwargs, "positions": cp.index(x.shape[1] * tp * cp.size, x.device)}
    return hook


def apply(blocks: list[nn.Module], indices: list[int], cp: ContextParallel, parts: list[bool],
          tp: int) -> None:
    """Context parallel on the held blocks `indices` of `blocks`, in place: each forward run
    under the attention mode, each that takes `positions` handed its part's (`parts[i]`: the
    block takes a sequence-parallel part, `tp` of which make the cp part)."""
    for i in indices:
        block = blocks[i]
        where = f"block {i} ({type(block).__name__})"
        if takes_positions(block):
            block.register_forward_pre_hook(_positions(cp, tp if parts[i] else 1), with_kwargs=True)
        block.forward = _attending(block.forward, cp, where)
