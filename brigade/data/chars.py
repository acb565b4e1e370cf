"""The built-in GPT's data: the characters of a text, each its own id.

The default corpus needs no download: the text of CPython's documentation topics
(`pydoc_data.topics`, about 465 kB), present wherever Python is. Example k is the window
starting at character k (`text.CharDataset`); `sampler.Sampler` draws them, as it draws a
tokenized model's windows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from brigade.data.text import CharDataset, read_text
from brigade.errors import BrigadeError


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


def load_text_data(path: str, block_size: int, val_fraction: float, val_path: str = "",
                   val_flag: str = "--val-data") -> tuple[Vocab, CharDataset, CharDataset]:
    """Vocabulary (the training text's characters), and train / validation sets: the text split at
    a fixed character position, its last `val_fraction` held out; or, given `val_path`
    (--val-data; `val_flag` names the option in an error's line), all of the text to train on and
    that held-out text to validate on.

    Raises:
        BrigadeError: either text shorter than one block, or a held-out text with characters the
            training text lacks (the model has no embedding for them).
    """
    text = read_text(path)
    vocab = Vocab.of(text)
    ids = vocab.encode(text)
    if len(ids) < block_size + 1:
        raise BrigadeError(
            f"the corpus has {len(ids)} characters, fewer than one block of {block_size} + 1: "
            "use more text or a smaller --block-size"
        )
    if val_path:
        held = _held_out(val_path, vocab, block_size, val_flag)
        return vocab, CharDataset(ids, block_size, "the training text"), held
    cut = int(len(ids) * (1 - val_fraction))
    train = CharDataset(ids[:cut], block_size, "training part of the corpus")
    val = CharDataset(ids[cut:], block_size, "validation part of the corpus")
    return vocab, train, val


def _held_out(path: str, vocab: Vocab, block_size: int, flag: str) -> CharDataset:
    """--val-data's text (`flag`'s) in the training text's vocabulary."""
    text = read_text(path, flag)
    unknown = sorted(set(text) - set(vocab.chars))
    if unknown:
        raise BrigadeError(f"{flag} {path!r} has {len(unknown)} character(s) the training text lacks "
                           f"({''.join(unknown[:12])!r}): the model knows only its training text's "
                           "characters; hold out text written in them")
    return CharDataset(vocab.encode(text), block_size, f"held-out text {path!r} ({flag})")
