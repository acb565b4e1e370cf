"""The unit a corpus is tokenized in."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """Text to tokenize as one unit: `loss` says whether its tokens are targets the loss counts,
    `starts_document` whether an end-of-sequence token goes before it (not before the corpus's
    first). A document is one piece or more: a long text file's pieces, a prompt and its
    completion, a chat's turns."""

    text: str
    loss: bool = True
    starts_document: bool = True
