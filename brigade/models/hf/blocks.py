"""A Hugging Face causal LM cut into brigade blocks: embedding, each decoder layer, norm + head.

Each block holds the family's own modules from `transformers` (a `LlamaDecoderLayer`, a
`GPT2Block`, ...) unchanged; the blocks only say what passes between them.

    Llama-like:  Embed(embed_tokens)  →  Decoder(layer) × L  →  Head(norm, lm_head)
                 tokens (B, T) → (B, T, C)    (B, T, C) → (B, T, C)    (B, T, C) → (B, T, V)
    GPT-2:       Embed(wte, wpe, drop) →  Decoder(block) × L →  Head(ln_f, lm_head)

Side inputs (brigade delivers them to every stage from the batch, see pipeline.stages.side_inputs):
    attention_mask       (B, T) bool, True on real tokens, where the batch has padding: each
                         decoder builds the causal mask (with the layer's sliding window, if it
                         has one) from it; None where the batch pads nothing (`layer_mask`)
    position_embeddings  Llama-like only: the rotary (cos, sin), each (B, T, D), computed once per
                         batch by the family's own rotary module (at each token's place in its
                         document, where the row packs several)
    documents            (B, T) int64, each token's document where a row packs several
                         (`models.documents`): attention stays within it, and GPT-2's positions
                         restart at each; None where every row is one sequence

`standalone` blocks (what `brigade bench`, `tune` and `plan` time: torch.distributed.pipelining,
their yardstick, hands each stage one tensor) take no side inputs: each decoder makes its
rotary (cos, sin) with its own copy of the rotary module and its mask for a batch of real
tokens (none: `layer_mask`). The layers, and so what is timed, are the same.

Attention: the layers run transformers' "sdpa" attention, which calls SDPA with is_causal=True
when it is handed no mask (and has more than one query); a GPU's flash kernel takes only that
form, never an explicit mask. So a decoder hands its layer no mask unless one says more than
causality: padding, packed documents, or a sliding window shorter than the sequence
(`layer_mask`).

Every block knows the name each of its tensors has in the directory (`hf_names`), so a rank
reads only its own blocks' tensors and an export writes them back under the same names, and the
name it has in transformers' own model (`memory_names`: the same, but for a mixture's experts,
which transformers stacks in memory and stores one tensor an expert: a `Stacked` name).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from brigade.models import documents as docs


def causal_mask(padding: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(B, T) bool, True on real tokens → (B, 1, T, T) bool, True where a query may attend.

    A query attends to earlier real keys (and within `window` positions, as transformers' sliding
    window: query − key < window), and always to itself, so that a padded row has a key.
    """
    t = padding.shape[1]
    q = torch.arange(t, device=padding.device)[:, None]
    k = torch.arange(t, device=padding.device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed = allowed & (q - k < window)
    return (allowed & padding[:, None, None, :]) | (q == k)


def layer_mask(padding: torch.Tensor | None, window: int | None, length: int,
               device: torch.device, documents: torch.Tensor | None = None) -> torch.Tensor | None:
    """The mask a decoder layer is handed: None where causality alone is the rule.

    Handed None, transformers' sdpa attention calls SDPA with is_causal=True, the only form a
    GPU's flash kernel takes; any explicit mask, even a purely causal one, rules that kernel out.
    A mask is built only for padding (`padding` given, (B, T) bool) or for a window that cuts:
    query − key reaches `length` − 1, so a window of `length` or more cuts nothing.

    Whether a batch has padding is decided once per batch where its inputs are made (the side
    input is None when it pads nothing, `HFModel.inputs`), not here: reading a tensor's values
    in every layer of every micro-batch would wait for the device each time. This function
    reads only shapes and ints.

    Args:
        padding: (B, T) bool, True on real tokens, or None (no padding).
        window: the layer's sliding window (None: none).
        length: the whole sequence's length T (under sequence parallel the hidden states hold
            a part of it; the attention sees all of it).
        device: where a mask is built.
        documents: (B, T) each token's document in a packed row, or None (one a row): a query
            attends only within its own (`models.documents.block_causal`).
    """
    if padding is None and documents is None and (window is None or window >= length):
        return None
    if padding is None:
        padding = torch.ones(1, length, dtype=torch.bool, device=device)
    mask = causal_mask(padding, window)
    return mask if documents is None else mask & docs.block_causal(documents)


@dataclass(frozen=True)
class Stacked:
    """A tensor stacked from one directory tensor per expert (a mixture's `gate_up_proj`, (E, 2H,
    C), or `down_proj`, (E, C, H)): `parts[e]` are expert e's tensors, concatenated along their
    first dimension (gate then up; or down alone), each stored as an nn.Linear's weight."""

    parts: tuple[tuple[str, ...], ...]

    def __str__(self) -> str:
        return f"{self.parts[0][0]} … ({len(self.parts)} experts)"


class Renamed(nn.Module):
    """A block whose tensors are named in the directory by prefix: `hf_prefixes` maps the
    block's own prefix ("layer.") to the directory's ("model.layers.3.")."""

    hf_prefixes: dict[str, str]

    def memory_names(self) -> dict[str, str]:
        """Every parameter and persistent buffer of the block → its name in transformers' model
        (but those a wrapper added from outside, `ADDED`: no directory holds them)."""
        return {name: hf_name(self.hf_prefixes, name) for name in self.state_dict()
                if name.rsplit(".", 1)[-1] not in ADDED}

    def hf_names(self) -> dict[str, str | Stacked]:
        """Every parameter and persistent buffer of the block → its name in the directory (a
        `Stacked` one for a mixture's experts)."""
        return self.memory_names()


# The names of parameters a wrapper gives a block's modules from outside: LoRA's adapters
# (`parallel.lora`), which the base model's directory never holds.
ADDED = ("lora_a", "lora_b")


def hf_name(prefixes: dict[str, str], name: str) -> str:
    """`name` inside a block → its directory name, by the block's `hf_prefixes`."""
    for ours, theirs in prefixes.items():
        if name.startswith(ours):
            return theirs + name[len(ours):]
    raise KeyError(f"{name} has no directory name (prefixes {sorted(prefixes)})")


class Embed(Renamed):
    """Llama-like: token ids (B, T) → embeddings (B, T, C)."""

    tp_plan: dict = {}  # whole on every tensor-parallel process

    def __init__(self, embed_tokens: nn.Embedding, prefix: str):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.hf_prefixes = {"embed_tokens.": f"{prefix}embed_tokens."}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class GPT2Embed(Renamed):
    """GPT-2: token ids (B, T) → token + position embeddings (B, T, C), then dropout; given the
    packed documents (None: one a row) as a side input."""

    tp_plan: dict = {}
    side_inputs = ("documents",)

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module, prefix: str,
                 standalone: bool = False):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop
        self.hf_prefixes = {"wte.": f"{prefix}wte.", "wpe.": f"{prefix}wpe."}
        if standalone:
            self.side_inputs = ()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, *,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """`positions` (T,): each token's place in its sequence (a part's global ones under
        context parallel), else 0..T−1; `documents` (B, T): restarting at each document."""
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        pos = positions[None, :] if documents is None else docs.positions(documents)
        return self.drop(self.wte(input_ids) + self.wpe(pos))


class Decoder(Renamed):
    """Llama-like: one decoder layer, (B, T, C) → (B, T, C), given the rotary (cos, sin), the
    padding mask (None: no padding) and the packed documents (None: one a row) as side inputs."""

    side_inputs = ("position_embeddings", "attention_mask", "documents")

    def __init__(self, layer: nn.Module, prefix: str, heads: int, kv_heads: int, window: int | None,
                 rotary: nn.Module | None = None, experts=None):
        super().__init__()
        self.layer, self.window = layer, window
        self.experts = experts  # a mixture's `families.ExpertNames` (None: a dense layer)
        if rotary is not None:  # standalone: no side inputs, the rotary made here
            self.rotary, self.side_inputs = rotary, ()
        self.hf_prefixes = {"layer.": prefix}
        # How --tp splits it: q, k, v by whole (key/value) heads, o row-wise; the MLP's gate and
        # up column-wise, down row-wise. The attention reads its heads from the tensor's shape.
        # Sequence parallel: the two norms on a part of the sequence, the attention and the MLP
        # each given the whole sequence once (as a DTensor, which only their projections read).
        self.tp_plan = {"layer.self_attn.q_proj": ("colwise", heads),
                        "layer.self_attn.k_proj": ("colwise", kv_heads),
                        "layer.self_attn.v_proj": ("colwise", kv_heads),
                        "layer.self_attn.o_proj": ("rowwise", heads),
                        "layer.mlp.gate_proj": "colwise", "layer.mlp.up_proj": "colwise",
                        "layer.mlp.down_proj": "rowwise",
                        "layer.input_layernorm": "sequence", "layer.post_attention_layernorm": "sequence",
                        "layer.self_attn": "gather", "layer.mlp": "gather"}
        if experts is not None:  # a mixture: whole on every tp process (split by --ep instead)
            for name in ("layer.mlp.gate_proj", "layer.mlp.up_proj", "layer.mlp.down_proj"):
                del self.tp_plan[name]
            self.tp_plan["layer.mlp"] = "whole"
        head = layer.self_attn.q_proj.out_features // heads
        for norm in ("q_norm", "k_norm"):  # Qwen3: one weight for every head, held whole
            if hasattr(layer.self_attn, norm):
                self.tp_plan[f"layer.self_attn.{norm}"] = "per-head"
                if getattr(layer.self_attn, norm).weight.numel() != head:  # OLMoE: a norm across heads,
                    self.tp_plan = None  # which split heads cannot take: --tp refuses the block
                    break

    def hf_names(self) -> dict[str, str | Stacked]:
        """`Renamed.hf_names`; a mixture's router and experts under the family's names on disk
        (`families.ExpertNames`), each expert's weights tensors of their own."""
        names = self.memory_names()
        if self.experts is None:
            return names
        at, on = self.hf_prefixes["layer."], self.experts
        n = self.layer.mlp.cfg.experts
        disk = f"{at}{on.moe}experts"
        names["layer.mlp.gate.weight"] = f"{at}{on.moe}gate.weight"
        names["layer.mlp.experts.gate_up_proj"] = Stacked(tuple(
            (f"{disk}.{e}.{on.gate}.weight", f"{disk}.{e}.{on.up}.weight") for e in range(n)))
        names["layer.mlp.experts.down_proj"] = Stacked(tuple((f"{disk}.{e}.{on.down}.weight",)
                                                             for e in range(n)))
        return names

    def forward(self, x: torch.Tensor, *, position_embeddings=None, attention_mask=None,
                documents=None) -> torch.Tensor:
        if position_embeddings is None:  # standalone: a batch of real tokens
            b, t = x.shape[:2]
            positions = torch.arange(t, device=x.device)[None, :].expand(b, -1)
            position_embeddings = self.rotary(x, positions)
        length = position_embeddings[0].shape[1]  # the whole sequence's, even where x holds a part
        mask = layer_mask(attention_mask, self.window, length, x.device, documents)
        return self.layer(x, attention_mask=mask, position_embeddings=tuple(position_embeddings))


class GPT2Decoder(Renamed):
    """GPT-2: one block, (B, T, C) → (B, T, C), given the padding mask (None: no padding) and the
    packed documents (None: one a row) as side inputs.

    Its attention and MLP are `Conv1D`s (weights stored transposed), which tensor parallel's
    plans do not split: it declares no plan, so --tp refuses GPT-2 in one line."""

    side_inputs = ("attention_mask", "documents")

    def __init__(self, block: nn.Module, prefix: str, standalone: bool = False):
        super().__init__()
        self.layer = block
        self.hf_prefixes = {"layer.": prefix}
        if standalone:
            self.side_inputs = ()

    def forward(self, x: torch.Tensor, *, attention_mask=None, documents=None) -> torch.Tensor:
        # No window: a mask only for padding or packing (standalone: one real sequence, so none).
        mask = layer_mask(attention_mask, None, x.shape[1], x.device, documents)
        return self.layer(x, attention_mask=mask)


class Head(Renamed):
    """The final norm and the output head: (B, T, C) → logits (B, T, V)."""

    per_position = True  # each position's logits from that position alone: the loss may chunk it

    def __init__(self, norm: nn.Module, lm_head: nn.Linear, norm_name: str, prefix: str, tied: bool = True):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head
        self.hf_prefixes = {"norm.": f"{prefix}{norm_name}.", "lm_head.": "lm_head."}
        # How --tp splits it: tied to the embedding, whole on every tensor-parallel process (the
        # embedding's weight is); untied, the norm on a part of the sequence and the vocabulary
        # split, the loss taking the logits split (`parallel.vocab`).
        self.tp_plan = {} if tied else {"norm": "sequence", "lm_head": "vocab"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))
