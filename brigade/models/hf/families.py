"""Which Hugging Face families brigade cuts into blocks, and what of a config it refuses.

    Llama-like   llama, mistral, qwen2, qwen3: model.embed_tokens, model.layers[i] (taking the
                 rotary (cos, sin) and a mask), model.norm, lm_head
    mixtures     qwen3_moe, mixtral, olmoe: Llama-like, each sparse layer's feed-forward a mixture
                 of experts, which brigade's own layer replaces (`models.moe.MoE`, configured by
                 `moe_config`, its weights where transformers keeps them: `mlp.gate.weight`,
                 `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`), so that expert parallel
                 can send its tokens (`parallel.experts`); on disk each expert's weights are
                 tensors of their own (`EXPERT_NAMES`)
    GPT-2        gpt2: transformer.wte + wpe, transformer.h[i], transformer.ln_f, lm_head

A family is supported when its layers keep that shape; a config field that changes what passes
between them in a way the blocks do not carry is refused by name (`check_config`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from brigade.errors import BrigadeError


@dataclass(frozen=True)
class Family:
    kind: str  # "llama" (Llama-like decoder) or "gpt2"
    base: str  # the attribute of the causal LM holding the decoder ("model", "transformer")
    embed: str  # the embedding's directory name, which a tied head shares
    dropouts: tuple[str, ...]  # config fields that are dropout probabilities (set from --dropout)


LLAMA = Family("llama", "model", "model.embed_tokens.weight", ("attention_dropout",))
GPT2 = Family("gpt2", "transformer", "transformer.wte.weight", ("resid_pdrop", "embd_pdrop", "attn_pdrop"))
FAMILIES = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "qwen3": LLAMA, "gpt2": GPT2,
            "qwen3_moe": LLAMA, "mixtral": LLAMA, "olmoe": LLAMA}


@dataclass(frozen=True)
class ExpertNames:
    """Where a family stores a mixture's weights on disk, inside a layer: the module (`moe`),
    its router `{moe}gate.weight`, and expert e's `{moe}experts.{e}.{gate|up|down}.weight`."""

    moe: str
    gate: str
    up: str
    down: str


EXPERT_NAMES = {"qwen3_moe": ExpertNames("mlp.", "gate_proj", "up_proj", "down_proj"),
                "olmoe": ExpertNames("mlp.", "gate_proj", "up_proj", "down_proj"),
                "mixtral": ExpertNames("block_sparse_moe.", "w1", "w3", "w2")}

# Config fields whose meaning the blocks do not carry: field → what it is.
REFUSED = {"quantization_config": "quantized weights", "add_cross_attention": "cross-attention",
           "is_encoder_decoder": "an encoder-decoder", "attn_logit_softcapping": "attention soft-capping",
           "attention_chunk_size": "chunked attention", "router_jitter_noise": "router jitter noise"}


def read_config(directory: Path) -> dict:
    """config.json of `directory`, as a dict, checked for a supported family.

    Raises:
        BrigadeError: no directory, no or unreadable config.json, an unsupported family.
    """
    if not directory.is_dir():
        raise BrigadeError(f"--model hf:{directory}: no such directory: give a directory written by "
                           "save_pretrained (config.json, model.safetensors, tokenizer.json)")
    path = directory / "config.json"
    if not path.is_file():
        raise BrigadeError(f"{directory} has no config.json: give a directory written by save_pretrained")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BrigadeError(f"{path} is not readable JSON ({exc}): write it again with save_pretrained") \
            from None
    family = raw.get("model_type")
    if family not in FAMILIES:
        raise BrigadeError(f"{path}: model_type {family!r} is not a family brigade cuts into blocks: "
                           f"supported are {', '.join(sorted(FAMILIES))}")
    _check_heads(raw, path)
    return raw


def _check_heads(raw: dict, path: Path) -> None:
    """Refuse heads that do not divide the hidden size, as transformers' own validator does (its
    message names neither the file nor the fix), and key/value heads that do not divide the heads
    (transformers builds such a model and fails in its first forward).

    Raises:
        BrigadeError: such a config, naming both numbers.
    """
    hidden = raw.get("n_embd" if raw.get("model_type") == "gpt2" else "hidden_size")
    heads = raw.get("n_head" if raw.get("model_type") == "gpt2" else "num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and (heads <= 0 or hidden % heads):
        raise BrigadeError(f"{path}: {heads} attention heads do not divide the hidden size {hidden}: "
                           "give a head count that divides it")
    kv = raw.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and (kv <= 0 or heads % kv):
        raise BrigadeError(f"{path}: {kv} key/value heads do not divide the {heads} attention heads "
                           "(each key/value head serves a whole group of them): give a divisor of "
                           f"{heads}")


def check_config(config, directory: Path) -> Family:
    """The family of a transformers config, after refusing what the blocks cannot carry.

    Raises:
        BrigadeError: a field of `REFUSED` is set.
    """
    for key, what in REFUSED.items():
        if getattr(config, key, None):
            raise BrigadeError(f"{directory}/config.json sets {key} ({what}), which brigade's blocks "
                               f"for {config.model_type} do not carry: use a config without it")
    return FAMILIES[config.model_type]


def moe_config(config, layer: int):
    """The `models.moe.MoEConfig` of decoder layer `layer`'s mixture of experts, as the family
    builds it (a softmax router, top-k, renormalised where the family does: Mixtral always,
    Qwen3-MoE and OLMoE by `norm_topk_prob`); None for a dense layer (Qwen3-MoE's
    `mlp_only_layers`, `decoder_sparse_step`) or a family without experts. The balancing loss is
    brigade's (sequence-wise, per layer) at the config's `router_aux_loss_coef` where the config
    trains with one (`output_router_logits`), else off, as transformers' training is.

    Raises:
        BrigadeError: an activation other than silu (the experts are SwiGLUs).
    """
    from brigade.models.moe import MoEConfig

    kind = config.model_type
    if kind not in EXPERT_NAMES:
        return None
    if kind == "qwen3_moe":
        sparse = layer not in (config.mlp_only_layers or []) and config.num_experts > 0 and \
            (layer + 1) % config.decoder_sparse_step == 0
        if not sparse:
            return None
    if getattr(config, "hidden_act", "silu") != "silu":
        raise BrigadeError(f"config.json: hidden_act {config.hidden_act!r} in a mixture of experts: "
                           "brigade's experts are SwiGLUs (silu); use a config with silu")
    experts = config.num_local_experts if kind == "mixtral" else config.num_experts
    hidden = config.moe_intermediate_size if kind == "qwen3_moe" else config.intermediate_size
    aux = config.router_aux_loss_coef if getattr(config, "output_router_logits", False) else 0.0
    return MoEConfig(experts=experts, top_k=config.num_experts_per_tok, hidden=hidden,
                     renormalize=kind == "mixtral" or bool(config.norm_topk_prob), aux_coef=aux)


def windows(config) -> list[int | None]:
    """Each decoder layer's sliding attention window (None: attends to every earlier token)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return [window if kind == "sliding_attention" else None for kind in types[:n]]
    if config.model_type == "mistral":
        return [window] * n
    return [None] * n


def tied(config, family: Family) -> dict[str, str]:
    """The names a directory may leave out because they share another's values."""
    return {"lm_head.weight": family.embed} if getattr(config, "tie_word_embeddings", False) else {}
