"""What a run trains: its model's blocks and loss, its data, and how its blocks get weights.

The data itself lives in `brigade.data`: the built-in GPT's characters (`data.chars`), a
tokenized model's shards or cached file (`data.prepared`), and the sampler every one of them is
read through (`data.sampler`); models without a dataset train on `SyntheticData`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from brigade.data.chars import Vocab, load_text_data
from brigade.errors import BrigadeError
from brigade.models import ModelSpec, load_model
from brigade.models.gpt import GPTConfig

if TYPE_CHECKING:
    from brigade.config import ModelConfig, RunConfig


class SyntheticData:
    """Random (input, target) pairs from a model's own batch maker, the same for the same index:
    the data of models that come without a dataset (toy, mlp, resnet50, a user's file)."""

    def __init__(self, spec: ModelSpec, n: int = 100_000):
        self.spec, self.n = spec, n

    def __len__(self) -> int:
        return self.n

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(int(indices.sum()) * 7919 + len(indices))
        return self.spec.make_batch(len(indices), g)


class Built(NamedTuple):
    """What a run trains: the model's blocks and loss, its data, and how its blocks get weights."""

    blocks: list
    loss_fn: object
    train: object
    val: object
    vocab: Vocab | None  # the GPT's characters; None for every other model
    # Fills a rank's own blocks after they are placed ({index: block}, device): a Hugging
    # Face directory's tensors, the blocks having been built without memory; None: the blocks
    # come with their weights.
    weights: Callable | None = None
    # The token shard set's content_sha256 (an hf:DIR model's data), which its snapshots record;
    # None for other data.
    data_sha256: str | None = None


def build(cfg: RunConfig, data: bool = True, val_flag: str = "--val-data") -> Built:
    """Blocks, loss, train and validation data, vocabulary (GPT; else None) and weights for a run.

    The model comes from the registry (`from_config`), a GPT sized to the text's real
    vocabulary. A model file trains on `--data`'s characters when given one (its factory gets
    `vocab_size` and `block_size`, its `text_inputs` makes its inputs from the ids), else on
    `SyntheticData`. An `hf:DIR` model trains on `--data` (or the built-in corpus) tokenized
    by DIR's tokenizer (`tokens`), its blocks without memory until each rank fills its own.

    `data` False: an `hf:DIR` model's data is left for later (train and val None), since it is
    written (tokenized into OUT/tokens); the launcher checks everything else first. `val_flag`:
    the option that named `cfg.data.val_data` (`brigade eval`'s is --data), for an error's line.

    Raises:
        BrigadeError: unreadable data, or a model the registry cannot build.
    """
    if cfg.model.model.startswith("hf:"):
        return _build_hf(cfg, data, val_flag)
    if cfg.model.model == "gpt" or cfg.data.data:
        vocab, train, val = load_text_data(cfg.data.data, cfg.data.block_size, cfg.data.val_fraction,
                                           cfg.data.val_data, val_flag)
        spec = from_config(cfg.model, cfg.train.seed, vocab_size=len(vocab), block_size=cfg.data.block_size)
        if spec.text_inputs is not None:
            train, val = TextInputs(train, spec.text_inputs), TextInputs(val, spec.text_inputs)
        return Built(spec.blocks, spec.loss_fn, train, val, vocab)
    if cfg.data.val_data:
        raise BrigadeError(f"{val_flag} {cfg.data.val_data!r}: {cfg.model.model} trains on made-up "
                           "batches, not text: give it --data FILE to hold text out from")
    spec = from_config(cfg.model, cfg.train.seed)
    return Built(spec.blocks, spec.loss_fn, SyntheticData(spec), SyntheticData(spec, 4096), None)


def _build_hf(cfg: RunConfig, data: bool = True, val_flag: str = "--val-data") -> Built:
    """`build` for `hf:DIR`: blocks on the meta device, and (`data`) their token windows.

    Raises:
        BrigadeError: as `load_hf` and `hf_data`; a sequence longer than the model's positions.
    """
    spec = from_config(cfg.model, cfg.train.seed, meta=True)
    config, d = spec.hf.config, cfg.data
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if positions and d.block_size > positions:
        raise BrigadeError(f"--block-size {d.block_size} is longer than the {positions} positions "
                           f"{cfg.model.model} knows: use --block-size ≤ {positions}")
    train = val = sha = None
    if data:
        train, val, sha = hf_data(cfg, spec, val_flag)
    return Built(spec.blocks, spec.loss_fn, train, val, None, spec.hf.load, sha)


def hf_data(cfg: RunConfig, spec: ModelSpec | None = None,
            val_flag: str = "--val-data") -> tuple[TextInputs, TextInputs, str]:
    """An `hf:DIR` model's training and validation windows: from a shard set (`--data` one, or the
    corpus tokenized into OUT/tokens by DIR's tokenizer: `data.prepared`; or several, mixed), as
    the blocks' inputs; and the digest of the ids they read, which the snapshots keep.

    Raises:
        BrigadeError: as `prepared.token_data`; a token id the model's vocabulary does not have.
    """
    from brigade.data.prepared import content_sha256, token_data

    spec = spec or from_config(cfg.model, cfg.train.seed, meta=True)
    vocab_size, d = spec.hf.config.vocab_size, cfg.data
    sets, train, val = token_data(d.data, str(spec.hf.directory), d.block_size, d.val_fraction,
                                  cfg.train.out, d.val_data, val_flag, d.document_mask)
    max_id = max(s.manifest.max_id for s in sets)
    if max_id >= vocab_size:
        raise BrigadeError(f"the tokenizer of {spec.hf.directory} gives id {max_id} "
                           f"but the model has {vocab_size} embeddings: use the tokenizer the "
                           "model was trained with")
    return TextInputs(train, spec.text_inputs), TextInputs(val, spec.text_inputs), content_sha256(sets)


class TextInputs:
    """A text dataset whose token ids become a model's inputs by the model file's `text_inputs`
    (e.g. the ids and a padding mask for a model that takes one as a side input); a shard set's
    windows with their documents (`--document-mask`) hand those to it too, by keyword."""

    def __init__(self, data, text_inputs):  # a text.CharDataset or a shards.TokenWindows
        self.data, self.text_inputs = data, text_inputs

    def __len__(self) -> int:
        return len(self.data)

    def batch(self, indices: torch.Tensor):
        x, y, *documents = self.data.batch(indices)
        return (self.text_inputs(x, documents=documents[0]) if documents else self.text_inputs(x)), y


def from_config(m: ModelConfig, seed: int = 0, vocab_size: int | None = None,
                block_size: int | None = None, meta: bool = False, standalone: bool = False,
                weights: bool = True) -> ModelSpec:
    """The model a run's configuration names: the one builder for training and its checks.

    Args:
        m: the run's model section.
        seed: draws the initial weights.
        vocab_size: the text's characters: required for "gpt"; a model file trained on text
            (`--data`) gets it as its factory's `vocab_size` argument, if it takes one.
        block_size: the training sequence length, likewise for a model file's `block_size`.
        meta: an `hf:DIR` model's blocks without memory (a training rank fills its own); its
            dropout probabilities are set from `m.dropout`.
        standalone: an `hf:DIR` model's blocks without side inputs (`models.hf.model.load_hf`).
        weights: False: an `hf:DIR` directory built on the meta device may have config.json
            alone (the planner, from the shapes).

    Raises:
        BrigadeError: as `load_model`.
        ValueError: a GPT without `vocab_size`.
    """
    if m.model.startswith("hf:"):
        return load_model(m.model, seed=seed, meta=meta, dropout=m.dropout, standalone=standalone,
                          weights=weights, **({"block_size": block_size} if block_size else {}))
    if m.model != "gpt":
        text = {"vocab_size": vocab_size, "block_size": block_size} if ":" in m.model else {}
        return load_model(m.model, seed=seed, **{k: v for k, v in text.items() if v is not None})
    if vocab_size is None:
        raise ValueError("a GPT needs the vocabulary size of its text")
    gpt_cfg = GPTConfig(vocab_size, m.context, m.n_layer, m.n_head, m.n_embd, m.dropout,
                        tie_embeddings=m.tie_embeddings, experts=m.experts, top_k=m.top_k)
    return load_model("gpt", seed=seed, gpt_cfg=gpt_cfg)
