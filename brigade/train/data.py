"""Character-level text data and a deterministic sampler with a global cursor.

The default corpus needs no download: the text of CPython's documentation
topics (`pydoc_data.topics`, about 465 kB), present wherever Python is.

Sampling: example k is the window starting at character k. Each epoch is a
permutation of all examples drawn from (seed, epoch); global batch n takes the
next `batch_size` indices from the cursor. A data-parallel rank takes its
contiguous slice of the global batch, so the cursor means the same thing
whatever dp is, and a run can resume under another layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from brigade.errors import BrigadeError
from brigade.models import ModelSpec, load_model
from brigade.models.gpt import GPTConfig
from brigade.train.text import CharDataset, default_corpus, read_text  # noqa: F401 (others ask here)

if TYPE_CHECKING:
    from brigade.config import ModelConfig, RunConfig


@dataclass
class Vocab:
    chars: str

    @classmethod
    def of(cls, text: str) -> Vocab:
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        index = {c: i for i, c in enumerate(self.chars)}
        unknown = {c for c in text if c not in index}
        if unknown:
            raise BrigadeError(f"characters not in the run's vocabulary: {''.join(sorted(unknown))!r}")
        return torch.tensor([index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def load_text_data(path: str, block_size: int, val_fraction: float) -> tuple[Vocab, CharDataset,
                                                                               CharDataset]:
    """Vocabulary, and train / validation sets split at a fixed character position."""
    text = read_text(path)
    vocab = Vocab.of(text)
    ids = vocab.encode(text)
    cut = int(len(ids) * (1 - val_fraction))
    if len(ids) < block_size + 1:
        raise BrigadeError(
            f"the corpus has {len(ids)} characters, fewer than one block of {block_size} + 1: "
            "use more text or a smaller --block-size"
        )
    train = CharDataset(ids[:cut], block_size, "training part of the corpus")
    val = CharDataset(ids[cut:], block_size, "validation part of the corpus")
    return vocab, train, val


class Sampler:
    """Global batches from per-epoch permutations; `cursor` is all the state there is."""

    def __init__(self, n_examples: int, batch_size: int, seed: int, cursor: int = 0):
        self.n = n_examples
        self.batch_size = batch_size
        self.seed = seed
        self.cursor = cursor  # examples consumed since the start of training
        self._epoch, self._perm = -1, None

    @property
    def epoch(self) -> int:
        return self.cursor // self.n

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=g)
        return self._perm

    def next_global(self) -> torch.Tensor:
        """The next global batch of example indices; advances the cursor."""
        out = []
        while len(out) < self.batch_size:
            epoch, pos = divmod(self.cursor, self.n)
            take = min(self.batch_size - len(out), self.n - pos)
            out.extend(self._permutation(epoch)[pos : pos + take].tolist())
            self.cursor += take
        return torch.tensor(out)

    @staticmethod
    def shard(indices: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        """This data-parallel rank's contiguous slice of a global batch."""
        per = len(indices) // world
        return indices[rank * per : (rank + 1) * per]


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


def build(cfg: RunConfig) -> Built:
    """Blocks, loss, train and validation data, vocabulary (GPT; else None) and weights for a run.

    The model comes from the registry (`from_config`), a GPT sized to the text's real
    vocabulary. A model file trains on `--data`'s characters when given one (its factory gets
    `vocab_size` and `block_size`, its `text_inputs` makes its inputs from the ids), else on
    `SyntheticData`. An `hf:DIR` model trains on `--data` (or the built-in corpus) tokenized
    by DIR's tokenizer (`tokens`), its blocks without memory until each rank fills its own.

    Raises:
        BrigadeError: unreadable data, or a model the registry cannot build.
    """
    if cfg.model.model.startswith("hf:"):
        return _build_hf(cfg)
    if cfg.model.model == "gpt" or cfg.data.data:
        vocab, train, val = load_text_data(cfg.data.data, cfg.data.block_size, cfg.data.val_fraction)
        spec = from_config(cfg.model, cfg.train.seed, vocab_size=len(vocab), block_size=cfg.data.block_size)
        if spec.text_inputs is not None:
            train, val = TextInputs(train, spec.text_inputs), TextInputs(val, spec.text_inputs)
        return Built(spec.blocks, spec.loss_fn, train, val, vocab)
    spec = from_config(cfg.model, cfg.train.seed)
    return Built(spec.blocks, spec.loss_fn, SyntheticData(spec), SyntheticData(spec, 4096), None)


def _build_hf(cfg: RunConfig) -> Built:
    """`build` for `hf:DIR`: token data from DIR's tokenizer, blocks on the meta device.

    Raises:
        BrigadeError: as `load_hf` and `tokens.load_token_data`; a sequence longer than the
            model's positions; a token id the model's vocabulary does not have.
    """
    from brigade.train.tokens import load_token_data

    spec = from_config(cfg.model, cfg.train.seed, meta=True)
    config, d = spec.hf.config, cfg.data
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if positions and d.block_size > positions:
        raise BrigadeError(f"--block-size {d.block_size} is longer than the {positions} positions "
                           f"{cfg.model.model} knows: use --block-size ≤ {positions}")
    _, train, val = load_token_data(d.data, str(spec.hf.directory), d.block_size, d.val_fraction)
    top = int(max(train.ids.max(), val.ids.max()))
    if top >= config.vocab_size:
        raise BrigadeError(f"the tokenizer of {spec.hf.directory} gives id {top} but the model has "
                           f"{config.vocab_size} embeddings: use the tokenizer the model was trained with")
    return Built(spec.blocks, spec.loss_fn, TextInputs(train, spec.text_inputs),
                 TextInputs(val, spec.text_inputs), None, spec.hf.load)


class TextInputs:
    """A text dataset whose token ids become a model's inputs by the model file's `text_inputs`
    (e.g. the ids and a padding mask for a model that takes one as a side input)."""

    def __init__(self, data: CharDataset, text_inputs):
        self.data, self.text_inputs = data, text_inputs

    def __len__(self) -> int:
        return len(self.data)

    def batch(self, indices: torch.Tensor):
        x, y = self.data.batch(indices)
        return self.text_inputs(x), y


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
                        tie_embeddings=m.tie_embeddings)
    return load_model("gpt", seed=seed, gpt_cfg=gpt_cfg)
