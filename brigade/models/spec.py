"""What every model is to brigade: `ModelSpec`, its blocks, loss and batches (the registry,
`brigade.models`, builds them; `models.hf` builds them from a Hugging Face directory)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class ModelSpec:
    name: str
    blocks: list[nn.Module]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    make_batch: Callable[[int, torch.Generator], Batch]
    # Trained on a text (--data): a batch of token ids (B, T) → the model's inputs (a model
    # file's `text_inputs`, e.g. adding a padding mask); None: the ids are the inputs.
    text_inputs: Callable[[torch.Tensor], object] | None = None
    # A Hugging Face directory's model (`models.hf.model.HFModel`): its config, weights and
    # tokenizer, for the commands that read or write them; None for every other model.
    hf: object | None = None
