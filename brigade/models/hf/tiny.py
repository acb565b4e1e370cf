"""A tiny random Hugging Face directory, written locally: what the tests and the docs fine-tune.

    python -m brigade.models.hf.tiny runs/tiny-llama --family llama

writes what `save_pretrained` writes for a model of that family (config.json,
model.safetensors) with random weights from `from_config`, and a byte-level BPE tokenizer
trained on brigade's built-in corpus (tokenizer.json and its config). No network.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from brigade.models.hf.deps import require

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "qwen3_moe", "mixtral", "olmoe")
SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 128}
# the mixtures: 4 experts of width 16 (Mixtral's and OLMoE's intermediate_size), top 2
EXPERTS = {"qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                         "head_dim": 8},
           "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16},
           "olmoe": {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16}}


def config(family: str, vocab_size: int, layers: int = 4, tie: bool = True, **extra):
    """A tiny config of `family` (4 heads, 2 key/value heads, width 32; GPT-2: its own names; a
    mixture: 4 experts, top 2)."""
    transformers = require("transformers")
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=layers, n_head=4,
                                       n_positions=128, bos_token_id=0, eos_token_id=0,
                                       tie_word_embeddings=tie, **extra)
    cls = transformers.AutoConfig.for_model(family).__class__
    extra = {k: list(v) if isinstance(v, tuple) else v for k, v in extra.items()}  # (1,): a hashable [1]
    shape = {**SHAPE, **({"head_dim": 8} if family == "qwen3" else {}), **EXPERTS.get(family, {}), **extra}
    return cls(vocab_size=vocab_size, num_hidden_layers=layers, tie_word_embeddings=tie, bos_token_id=0,
               eos_token_id=0, pad_token_id=None, **shape)


# A ChatML-like template: each message between its role's header and an end marker.
CHAT_TEMPLATE = ("{% for m in messages %}"
                 "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tokenizer(vocab_size: int = 256):
    """A byte-level BPE trained on the built-in corpus, "<|endoftext|>" its end of text."""
    tokenizers = require("tokenizers")
    from pydoc_data.topics import topics  # brigade's built-in corpus (train.data reads the same)

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([topics[k] for k in sorted(topics)], trainer)
    return tok


def write(out: str | Path, family: str = "llama", layers: int = 4, tie: bool = True, seed: int = 0,
          vocab_size: int = 256, **extra) -> Path:
    """A tiny random `family` model and its tokenizer, saved to `out` as save_pretrained does."""
    transformers = require("transformers")
    out = Path(out)
    tok = tokenizer(vocab_size)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config(family, tok.get_vocab_size(), layers, tie,
                                                                 **extra))
    model.save_pretrained(out)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE  # chats of JSON Lines corpora render (`data.instruct`)
    fast.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m brigade.models.hf.tiny", description=__doc__.split("\n")[0])
    p.add_argument("out", help="the directory to write")
    p.add_argument("--family", default="llama", choices=FAMILIES, help="model_type (default: llama)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default: 4)")
    args = p.parse_args(argv)
    print(f"wrote {write(args.out, args.family, args.layers)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
