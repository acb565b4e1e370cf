"""Document-aware packing: several documents share a training row, but none sees another.

A packed row carries, beside its token ids, `documents` (B, T) int64: each token's document,
counted from 0 at the row's first token (a document cut by the window's start is document 0)
and going up by one at each document start:

    tokens      a3 a4 EOS | b0 b1 b2 EOS | c0 c1
    documents    0  0  0  |  1  1  1  1  |  2  2
    positions    0  1  2  |  0  1  2  3  |  0  1       (`positions`)
    a query attends to the keys of its own document at or before it   (`block_causal`)

so each document's logits are those of the document run alone from its first token in the row:
a packed batch's loss is the documents' losses one by one (tests/models/test_documents.py).

The one place that decides how: `attend`. On a CUDA device it runs torch's FlexAttention with a
block mask (compiled once; blocks of 128 × 128 that cross no boundary cost nothing, and those
wholly in another document are skipped), where the dropout is 0; everywhere else SDPA with the
boolean (B, 1, T, T) mask (FlexAttention on the CPU has no backward in torch 2.13, and
compiling it costs half a minute). The Hugging Face families take the boolean mask through their
own "sdpa" attention (`models.hf.blocks.layer_mask`).

Models take `documents` as a side input (None: one document a row, plain causal attention);
nothing here knows of parallelism: under tensor parallel the heads are split and the mask is
the same for each; context parallel refuses it (`config.validate`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_FLEX = {}  # the compiled flex_attention, made on first use on a CUDA device


def positions(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) document of each token → (B, T) its place in its document: 0 at each start."""
    t = documents.shape[-1]
    index = torch.arange(t, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first


def block_causal(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) document of each token → (B, 1, T, T) bool, True where a query may attend: a key of
    its own document, at or before it."""
    t = documents.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=documents.device).tril()
    return (documents[:, None, :, None] == documents[:, None, None, :]) & causal


def packed(documents: torch.Tensor | None) -> torch.Tensor | None:
    """`documents` where a row holds more than one document, else None (plain causal attention,
    which a GPU's flash kernel takes): read once per batch where the batch is made, on the host."""
    if documents is None or not bool((documents != documents[:, :1]).any()):
        return None
    return documents


def use_flex(device: torch.device, dropout_p: float) -> bool:
    """Whether `attend` takes FlexAttention: on CUDA, without dropout (flex has none)."""
    return device.type == "cuda" and dropout_p == 0.0


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor,
           dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention within each document: q, k, v (B, H, T, D), documents (B, T) → (B, H, T, D)."""
    if use_flex(q.device, dropout_p):
        return _flex(q, k, v, documents)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal(documents), dropout_p=dropout_p)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "run" not in _FLEX:  # eager flex materializes the scores: it is meant to be compiled
        _FLEX["run"] = torch.compile(flex_attention, dynamic=False)

    def same_document(b, h, q_idx, kv_idx):
        return (documents[b, q_idx] == documents[b, kv_idx]) & (kv_idx <= q_idx)

    b, _, t, _ = q.shape
    held = _FLEX.get("mask")
    if held is None or held[0] is not documents:  # every layer of a micro-batch gets one tensor
        held = _FLEX["mask"] = (documents, create_block_mask(same_document, b, None, t, t, device=q.device))
    return _FLEX["run"](q, k, v, block_mask=held[1])


def random_documents(n: int, t: int, g: torch.Generator, most: int = 4) -> torch.Tensor:
    """(n, t) documents of made-up packed rows, up to `most` documents a row cut at random
    places (`brigade check --documents`, the models' synthetic batches)."""
    rows = []
    for _ in range(n):
        cuts = torch.randperm(t - 1, generator=g)[: int(torch.randint(0, most, (1,), generator=g))] + 1
        row = torch.zeros(t, dtype=torch.int64)
        row[cuts] = 1
        rows.append(row.cumsum(0))
    return torch.stack(rows)
