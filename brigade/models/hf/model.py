"""`--model hf:DIR`: a local Hugging Face directory as a brigade `ModelSpec`.

    spec = load_hf("hf:path/to/dir")           blocks with the directory's weights (one process)
    spec = load_hf("hf:path/to/dir", meta=True)  blocks without memory: each rank materializes
                                                 and fills only its own (`spec.hf.load`)

The blocks hold the family's own modules (blocks.py); the batch a model of this kind takes is
`{"input_ids": (B, T), "attention_mask": (B, T) bool or None, "position_embeddings": (cos, sin),
"documents": (B, T) int64 or None}` (GPT-2: no rotary; the mask None where nothing is padding,
the documents None where no row packs several: `models.documents`), made from token ids by
`spec.text_inputs`, and the loss is the mean next-token cross-entropy, as transformers' causal
LM loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from brigade.errors import BrigadeError
from brigade.models.documents import packed, random_documents
from brigade.models.documents import positions as doc_positions
from brigade.models.hf import blocks as hb
from brigade.models.hf import families
from brigade.models.hf.deps import require
from brigade.models.hf.weights import Checkpoint, check_blocks, has_weights, load_blocks, materialize
from brigade.models.spec import ModelSpec

PREFIX = "hf:"
IGNORE = -100  # a target transformers' loss skips


def directory_of(name: str) -> Path:
    return Path(name[len(PREFIX):]).expanduser()


@dataclass
class HFModel:
    """What brigade keeps of a directory: its config, family and weights, and the rotary module."""

    directory: Path
    config: object  # transformers.PretrainedConfig
    family: families.Family
    checkpoint: Checkpoint | None  # None: a config-only directory, planned from its shapes
    rotary: nn.Module | None = None
    dropout: float = 0.0

    def load(self, blocks: dict[int, nn.Module], device: torch.device | str) -> None:
        """Materialize `blocks` ({index: block}) on `device` where they have no memory yet, and
        fill them from the directory (a DTensor: only its own part)."""
        materialize(nn.ModuleList(blocks.values()), device)  # at once: a tie held here stays one
        load_blocks(blocks, self.checkpoint)

    def original(self) -> nn.Module:
        """The unmodified transformers model of the directory (what `brigade check` compares with)."""
        transformers = require("transformers")
        transformers.utils.logging.disable_progress_bar()  # one line per command, not a bar per load
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(self.directory), config=self.config, attn_implementation="sdpa", dtype=torch.float32,
            local_files_only=True)
        return model.train()

    def inputs(self, ids: torch.Tensor, padding: torch.Tensor | None = None,
               documents: torch.Tensor | None = None) -> dict:
        """Token ids (B, T), which of them are real tokens, and their documents → the inputs the
        blocks take.

        The padding is read here, once per batch where the batch is made (on the host, before
        it moves to a device), and a mask that pads nothing becomes the side input None: each
        decoder then hands its layer no mask, and the attention runs SDPA with is_causal=True
        (blocks.layer_mask). Reading it in each layer instead would wait for the device there,
        once per layer and micro-batch.

        Args:
            ids: (B, T) token ids.
            padding: (B, T), true (or 1) on real tokens, as a tokenizer's attention_mask; None:
                every position is a real token (brigade's packed sequences).
            documents: (B, T) int64, each token's document in its packed row
                (`models.documents`); None, or one document a row: plain causal attention.

        Raises:
            BrigadeError: `padding` or `documents` not of the shape of `ids`.
        """
        for what, given in (("a padding mask", padding), ("documents", documents)):
            if given is not None and given.shape != ids.shape:
                raise BrigadeError(f"{what} of shape {tuple(given.shape)} for token ids of shape "
                                   f"{tuple(ids.shape)}: give one entry per token")
        if padding is not None and bool(padding.all()):
            padding = None
        documents = packed(documents)  # read here, once a batch, as the padding is
        out = {"input_ids": ids, "attention_mask": None if padding is None else padding.bool(),
               "documents": documents}
        if self.rotary is not None:
            positions = torch.arange(ids.shape[1])[None, :].expand(ids.shape[0], -1)
            if documents is not None:
                positions = doc_positions(documents)
            with torch.no_grad():
                out["position_embeddings"] = self.rotary(torch.zeros(1), positions)
        return out


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every target that is not IGNORE: (B, T, V), (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE)


def _config(directory: Path, dropout: float):
    raw = families.read_config(directory)
    transformers = require("transformers")
    try:
        config = transformers.AutoConfig.for_model(**raw)
    except Exception as exc:  # noqa: BLE001 -- transformers' and huggingface_hub's own kinds too
        cause = " ".join(str(exc).split())  # its validators' messages run over several lines
        raise BrigadeError(f"{directory}/config.json: transformers cannot read it ({cause}): write it "
                           "again with save_pretrained") from None
    family = families.check_config(config, directory)
    for key in family.dropouts:
        if hasattr(config, key):
            setattr(config, key, dropout)
    config._attn_implementation = "sdpa"
    return config, family


def _cut(model: nn.Module, config, family: families.Family, standalone: bool) -> list[nn.Module]:
    """The causal LM's modules as blocks: embedding, each layer, norm + head."""
    base = getattr(model, family.base)
    if family.kind == "gpt2":
        first = hb.GPT2Embed(base.wte, base.wpe, base.drop, "transformer.", standalone)
        layers = [hb.GPT2Decoder(b, f"transformer.h.{j}.", standalone) for j, b in enumerate(base.h)]
        return [first, *layers, hb.Head(base.ln_f, model.lm_head, "ln_f", "transformer.", _tied(config))]
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    mixtures = [_mixture(layer, config, j) for j, layer in enumerate(base.layers)]
    layers = [hb.Decoder(layer, f"model.layers.{j}.", config.num_attention_heads, kv, window,
                         _rotary(base, config) if standalone else None, experts)
              for j, (layer, window, experts)
              in enumerate(zip(base.layers, families.windows(config), mixtures))]
    head = hb.Head(base.norm, model.lm_head, "norm", "model.", _tied(config))
    return [hb.Embed(base.embed_tokens, "model."), *layers, head]


def _mixture(layer: nn.Module, config, j: int):
    """Layer j's mixture of experts, if it has one, replaced by brigade's (`families.moe_config`;
    built where the layer's weights are, on the meta device); its `families.ExpertNames`."""
    cfg = families.moe_config(config, j)
    if cfg is None:
        return None
    from brigade.models.moe import MoE

    with torch.device(layer.input_layernorm.weight.device):
        layer.mlp = MoE(config.hidden_size, cfg)
    return families.EXPERT_NAMES[config.model_type]


def _tied(config) -> bool:
    """Whether the head reuses the token embedding's weight (transformers' default: tied)."""
    return bool(getattr(config, "tie_word_embeddings", True))


def _rotary(base: nn.Module, config) -> nn.Module:
    """The family's rotary module, on the CPU whatever the ambient device (its buffers are
    computed, not read: a meta copy would have none)."""
    with torch.device("cpu"):
        return type(base.rotary_emb)(config=config)


def load_hf(name: str, seed: int = 0, meta: bool = False, dropout: float = 0.0,
            block_size: int = 16, standalone: bool = False, weights: bool = True, documents: bool = False,
            **_) -> ModelSpec:
    """The directory of `name` ("hf:DIR") as blocks.

    Args:
        meta: leave the blocks without memory (a training rank fills only its own, `spec.hf.load`);
            otherwise every block holds the directory's weights.
        dropout: replaces every dropout probability of the config (0: none).
        block_size: sequence length of the synthetic batches `make_batch` draws (check, bench).
        standalone: blocks that take no side inputs, each decoder making its own rotary and
            mask (blocks.py): a batch is then the token ids alone (bench, tune, plan).
        weights: whether the directory must hold weights; False (plan, from the shapes): a
            directory with config.json alone is enough (`checkpoint` None), and weights that
            are there are still checked against the config.
        documents: the synthetic batches pack a few documents a row (`brigade check --documents`).

    Raises:
        BrigadeError: no directory, config.json or weights; an unsupported family or field; a
            missing tensor or one of the wrong shape; transformers not installed.
    """
    directory = directory_of(name)
    meta = meta or torch.empty(0).is_meta  # under `with torch.device("meta")` (plan): shapes only
    config, family = _config(directory, dropout)
    needed = weights or not meta or has_weights(directory)  # blocks with memory need their values
    checkpoint = Checkpoint(directory, families.tied(config, family)) if needed else None
    transformers = require("transformers")
    with torch.device("meta"):  # fp32 whatever dtype config.json names: brigade's master weights
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                              dtype=torch.float32)
    blocks = _cut(model, config, family, standalone)
    rotary = None
    if family.kind == "llama" and not standalone:
        rotary = _rotary(getattr(model, family.base), config)  # real: (cos, sin) per batch
    hf = HFModel(directory, config, family, checkpoint, rotary, dropout)
    if checkpoint is not None:
        check_blocks(blocks, checkpoint)  # every tensor there, of its shape: from the headers alone
    if not meta:
        hf.load(dict(enumerate(blocks)), "cpu")
    vocab = config.vocab_size

    def make_batch(n: int, g: torch.Generator):
        seq = torch.randint(vocab, (n, block_size + 1), generator=g)
        if standalone:
            return seq[:, :-1], seq[:, 1:]
        packing = random_documents(n, block_size, g) if documents else None
        return hf.inputs(seq[:, :-1], documents=packing), seq[:, 1:]

    return ModelSpec(name, blocks, causal_lm_loss, make_batch, None if standalone else hf.inputs, hf=hf)
