"""The built-in GPT's data: the characters of a text, each its own id.

The default corpus needs no download: the text of CPython's documentation topics
(`pydoc_data.topics`, about 465 kB), present wherever Python is. Example k is the window
starting at character k (`text.CharDataset`); `sampler.Sampler` draws them, as it draws a
tokenized model's windows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from brigade.data import mix
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
        """The ids of `text`'s characters: each character's code point looked up among the
        vocabulary's by a sorted search, not a loop in Python over the corpus (every rank of every
        run encodes its whole text, half a million characters by default, and the loop took 0.2 s
        of a tiny run's 2).

        In numpy, not torch: the agent encodes too before it forks its workers, and a torch op
        this long runs on OpenMP's threads, after which a forked child's first parallel op waits
        for ever (GNU OpenMP is not fork-safe; `brigade train --threads 2` hung so).

        Raises:
            BrigadeError: `text` has characters the vocabulary lacks.
        """
        points = _code_points(self.chars)
        order = np.argsort(points, kind="stable")
        known = points[order]
        codes = _code_points(text)
        at = np.minimum(np.searchsorted(known, codes), max(len(known) - 1, 0))
        missing = known[at] != codes if len(known) else np.ones(len(codes), dtype=bool)
        if missing.any():
            unknown = {chr(c) for c in codes[missing].tolist()}
            raise BrigadeError(f"characters not in the run's vocabulary: {''.join(sorted(unknown))!r}")
        return torch.from_numpy(order[at] if len(known) else codes.astype(np.int64))

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def _code_points(text: str) -> np.ndarray:
    """`text`'s Unicode code points (through UTF-32, four bytes a character)."""
    return np.frombuffer(text.encode("utf-32-le"), dtype="<u4").astype(np.int64)


def load_text_data(path: str, block_size: int, val_fraction: float, val_path: str = "",
                   val_flag: str = "--val-data") -> tuple[Vocab, CharDataset, CharDataset]:
    """Vocabulary (the training text's characters), and train / validation sets: the text split at
    a fixed character position, its last `val_fraction` held out; or, given `val_path`
    (--val-data; `val_flag` names the option in an error's line), all of the text to train on and
    that held-out text to validate on. `path` may name several texts by weight
    (`a.txt:0.7,b.txt:0.3`, `data.mix`): the vocabulary is all of theirs, and each is split (or
    trained on whole) as one text would be, the parts mixed by the weights.

    Raises:
        BrigadeError: either text shorter than one block, or a held-out text with characters the
            training text lacks (the model has no embedding for them); a mixture `mix.parse`
            refuses.
    """
    corpora = mix.parse(path) or [(path, 1.0)]
    texts = [read_text(p) for p, _ in corpora]
    vocab = Vocab.of("".join(texts))
    parts = [_split(vocab.encode(t), block_size, val_fraction, p if len(corpora) > 1 else "", val_path)
             for t, (p, _) in zip(texts, corpora)]
    held = _held_out(val_path, vocab, block_size, val_flag) if val_path else None
    if len(corpora) == 1:
        train, val = parts[0]
        return vocab, train, held or val
    weights = [w for _, w in corpora]
    train = mix.Mixture([t for t, _ in parts], weights)
    return vocab, train, held or mix.Mixture([v for _, v in parts], weights)


def _split(ids: torch.Tensor, block_size: int, val_fraction: float, name: str,
           val_path: str) -> tuple[CharDataset, CharDataset | None]:
    """One text's training part and its last `val_fraction` (all of it trains, and None, where
    --val-data holds text out instead); `name`: the corpus's path in a mixture, for errors."""
    of = f" of {name!r}" if name else " of the corpus"
    if len(ids) < block_size + 1:
        raise BrigadeError(
            f"the corpus{' ' + repr(name) if name else ''} has {len(ids)} characters, fewer than one "
            f"block of {block_size} + 1: use more text or a smaller --block-size"
        )
    if val_path:
        return CharDataset(ids, block_size, f"the training text{of[3:] if name else ''}"), None
    cut = int(len(ids) * (1 - val_fraction))
    return (CharDataset(ids[:cut], block_size, f"training part{of}"),
            CharDataset(ids[cut:], block_size, f"validation part{of}"))


def _held_out(path: str, vocab: Vocab, block_size: int, flag: str) -> CharDataset | mix.Mixture:
    """--val-data's text (`flag`'s) in the training text's vocabulary; several, mixed by weight."""
    corpora = mix.parse(path, flag)
    if corpora is not None:
        parts = [_held_out(p, vocab, block_size, flag) for p, _ in corpora]
        return mix.Mixture(parts, [w for _, w in corpora])
    text = read_text(path, flag)
    unknown = sorted(set(text) - set(vocab.chars))
    if unknown:
        raise BrigadeError(f"{flag} {path!r} has {len(unknown)} character(s) the training text lacks "
                           f"({''.join(unknown[:12])!r}): the model knows only its training text's "
                           "characters; hold out text written in them")
    return CharDataset(vocab.encode(text), block_size, f"held-out text {path!r} ({flag})")
