"""Sampling text from a run's newest snapshot (`brigade generate`, and the sample at the end of training)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from brigade.config import ModelConfig
from brigade.data.chars import Vocab
from brigade.errors import BrigadeError
from brigade.models import load_model
from brigade.models.gpt import GPTConfig
from brigade.parallel import lora
from brigade.parallel.assemble import OwnedBlocks
from brigade.snapshot.collective import load_model_only
from brigade.snapshot.format import Snapshot, resolve


@torch.no_grad()
def generate(model, idx: torch.Tensor, tokens: int, context: int,
             temperature: float = 0.8, top_k: int | None = 20, generator=None) -> torch.Tensor:
    """Append `tokens` sampled tokens to idx (1, T); `model`: ids (1, T) → logits (1, T, V)."""
    for _ in range(tokens):
        logits = model(idx[:, -context:])[:, -1, :] / max(temperature, 1e-6)
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1, None]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    return idx


def sample_from_run(path: str | Path, prompt: str, tokens: int, seed: int = 0,
                    temperature: float = 0.8) -> str:
    """Load the newest good snapshot under `path` (run or snapshot folder) and continue `prompt`.

    Raises:
        BrigadeError: no snapshot, not a GPT run, or characters the run never saw.
    """
    return sample_from_snapshot(resolve(path), prompt, tokens, seed, temperature)


def sample_from_snapshot(found: Snapshot, prompt: str, tokens: int, seed: int = 0,
                         temperature: float = 0.8) -> str:
    """Continue `prompt` with the GPT (or hf:DIR model) of the verified snapshot `found` (see
    `sample_from_run`)."""
    path = found.path
    manifest = found.manifest
    is_hf = manifest.model.startswith("hf:")
    if not is_hf and (manifest.model != "gpt" or not manifest.vocab):
        raise BrigadeError(f"{path} is a {manifest.model} run: generate needs a GPT trained on text "
                           "or an hf:DIR model")
    if tokens < 1:
        raise BrigadeError(f"--tokens {tokens}: must be ≥ 1")
    if is_hf:
        return _sample_hf(found, prompt, tokens, seed, temperature)
    try:
        m = ModelConfig(**manifest.config.get("model", {}))
    except TypeError:
        raise BrigadeError(f"{found.path}: the manifest's config.model is not a brigade model config: "
                           "the snapshot is damaged or from another version") from None
    vocab = Vocab(manifest.vocab)
    blocks = load_model("gpt", seed=manifest.config.get("train", {}).get("seed", 0),
                        gpt_cfg=GPTConfig(len(vocab), m.context, m.n_layer, m.n_head, m.n_embd, 0.0,
                                          m.tie_embeddings, m.experts, m.top_k)).blocks
    if (adapters := lora.from_config(manifest.config)) is not None:  # the base from its seed, as trained
        lora.apply(blocks, list(range(len(blocks))), adapters)
    owned = OwnedBlocks(blocks, list(range(len(blocks))))
    load_model_only(found.path, owned)
    model = nn.Sequential(*blocks).eval()
    idx = vocab.encode(prompt or "\n")[None, :]
    g = torch.Generator().manual_seed(seed)
    out = generate(model, idx, tokens, m.context, temperature, generator=g)
    return vocab.decode(out[0].tolist())


def _sample_hf(found: Snapshot, prompt: str, tokens: int, seed: int, temperature: float) -> str:
    """`sample_from_snapshot` for an `hf:DIR` run: its blocks, the directory's tokenizer."""
    from brigade.data.tokenizer import load_tokenizer
    from brigade.pipeline.stages.side_inputs import whole
    from brigade.train.export import trained_blocks

    blocks, hf = trained_blocks(found)
    tokenizer = load_tokenizer(str(hf.directory))
    model = whole(blocks).eval()
    ids = tokenizer.encode(prompt or "\n", add_special_tokens=False).ids or [0]
    context = found.manifest.config.get("data", {}).get("block_size", 128)
    g = torch.Generator().manual_seed(seed)
    out = generate(lambda idx: model(hf.inputs(idx)), torch.tensor([ids]), tokens, context, temperature,
                   generator=g)
    return tokenizer.decode(out[0].tolist(), skip_special_tokens=False)


def main_generate(path: str, prompt: str, tokens: int, seed: int, temperature: float) -> int:
    """`brigade generate`: the sample on stdout; on stderr, which snapshot it came from (after a
    warning for each newer one that was damaged and skipped)."""
    found = resolve(path)
    print(f"brigade generate: sampling from snapshot step {found.manifest.step} ({found.path})",
          file=sys.stderr, flush=True)
    print(sample_from_snapshot(found, prompt, tokens, seed, temperature), file=sys.stdout)
    return 0
