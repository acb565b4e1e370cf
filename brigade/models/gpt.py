"""A minGPT-style decoder as an ordered list of blocks: embedding, transformer blocks, head.

Shapes: B batch, T time (≤ block_size), C n_embd, V vocab_size.
With `tie_embeddings` (the default) the head's output weight is the token embedding's: one
parameter on the first and last block, which brigade keeps as one copy per stage with summed
gradients (brigade.pipeline.stages.ties). With `experts` each block's feed-forward is a mixture
of experts instead (`brigade.models.moe`: top-k routing, SwiGLU experts of width 2C, the
load-balancing loss at `aux_coef`).

With `documents` the blocks take a side input of that name, (B, T) int64, each token's document in
its packed row (`brigade.models.documents`): positions restart at each document and attention
stays within it. None (or `documents` False: no side input): one sequence a row, as ever.

Each block declares how tensor parallel splits it (`tp_plan`, read by brigade.parallel.tensor):
attention's fused q/k/v column-wise and its output row-wise, by whole heads; the MLP's up
column-wise and its down row-wise; under sequence parallel its two norms run on a part of the
sequence and the attention and the MLP each gather their input once. The embedding declares an
empty plan (whole on every tensor-parallel process), and so does a head tied to it; an untied head
splits its vocabulary, and the loss takes its logits split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from brigade.models import documents as docs
from brigade.models.moe import MoE, MoEConfig

SIDE = ("documents",)  # the side inputs of a GPT with `documents`


@dataclass
class GPTConfig:
    vocab_size: int = 96
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    tie_embeddings: bool = True  # the head reuses the token embedding's weight (V, C)
    experts: int = 0  # > 0: each block's feed-forward a mixture of experts (`models.moe`)
    top_k: int = 2  # the experts each token goes to
    aux_coef: float = 0.01  # the load-balancing loss's weight (Switch Transformer's)
    documents: bool = False  # the blocks take the side input `documents` (module docstring)


class Embedding(nn.Module):
    tp_plan: dict = {}  # whole on every tensor-parallel process

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.block_size = cfg.block_size
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        if cfg.documents:
            self.side_inputs = SIDE

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None, *,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) int64 → (B, T, C); `positions` (T,): each token's place in its sequence (brigade
        hands a part of a sequence its global ones under context parallel), else 0..T−1;
        `documents` (B, T): positions restart at each document instead."""
        t = idx.shape[1]
        if positions is None and t > self.block_size:  # given positions: the whole was checked
            raise ValueError(f"sequence length {t} exceeds block_size {self.block_size}")
        pos = torch.arange(t, device=idx.device) if positions is None else positions
        if documents is not None:
            pos = docs.positions(documents)  # (B, T)
        return self.drop(self.tok(idx) + self.pos(pos))


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.d = cfg.n_embd // cfg.n_head  # head size
        # Rows of qkv are head-major, each head's q, k and v adjacent (Megatron-LM's layout for a
        # fused projection): a split of the rows hands each tensor-parallel process whole heads.
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, C) -> (B, T, C); `documents` (B, T): attention within each (`models.documents`)."""
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, -1, 3, self.d)  # (B, T, H, 3, D); H: the heads held here
        q, k, v = (qkv[..., i, :].transpose(1, 2) for i in range(3))  # (B, H, T, D) each
        p = self.dropout if self.training else 0.0
        if documents is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, H, T, D)
        else:
            y = docs.attend(q, k, v, documents, p)
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, t, -1)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        if cfg.documents:
            self.side_inputs = SIDE
        self.tp_plan = {"attn.qkv": ("colwise", cfg.n_head), "attn.proj": ("rowwise", cfg.n_head),
                        "ln1": "sequence", "ln2": "sequence", "attn": "gather"}
        if cfg.experts:  # each expert a SwiGLU of width 2C, whole on every tp process (parallel.tensor)
            moe = MoEConfig(cfg.experts, cfg.top_k, 2 * cfg.n_embd, aux_coef=cfg.aux_coef)
            self.mlp = MoE(cfg.n_embd, moe)
            self.tp_plan["mlp"] = "whole"
            return
        self.tp_plan.update({"mlp.0": "colwise", "mlp.2": "rowwise", "mlp": "gather"})
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor, *, documents: torch.Tensor | None = None) -> torch.Tensor:
        # (B, T, C) -> (B, T, C); documents by keyword: sequence parallel's hooks convert only x
        x = x + self.attn(self.ln1(x), documents=documents)
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    per_position = True  # each position's logits from that position alone: the loss may chunk it

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.out = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # Tied to the embedding: whole on every tensor-parallel process, as the embedding is.
        # Untied: the norm on a part of the sequence, the vocabulary split (the loss takes it so).
        self.tp_plan = {} if cfg.tie_embeddings else {"ln": "sequence", "out": "vocab"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, V)
        return self.out(self.ln(x))


def gpt(cfg: GPTConfig | None = None) -> list[nn.Module]:
    """The GPT as blocks: [Embedding, Block × n_layer, Head], the head tied to the embedding
    when `cfg.tie_embeddings`."""
    cfg = cfg or GPTConfig()
    if cfg.n_embd % cfg.n_head:
        raise ValueError(f"n_embd={cfg.n_embd} must be a multiple of n_head={cfg.n_head}")
    blocks: list[nn.Module] = [Embedding(cfg)]
    blocks += [Block(cfg) for _ in range(cfg.n_layer)]
    blocks.append(Head(cfg))
    for b in blocks:
        b.apply(_init)
    if cfg.tie_embeddings:
        blocks[-1].out.weight = blocks[0].tok.weight
    return blocks


def _init(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, std=0.02)


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token: (B, T, V), (B, T) -> scalar."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
