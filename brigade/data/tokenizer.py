"""A model directory's tokenizer: read it, find its end-of-sequence token, hash it.

The tokenizer is the `tokenizer.json` that `save_pretrained` writes into DIR, read with the
`tokenizers` library (the optional `hf` extra), so the ids are the model's own. Its hash is
what a shard set records and a run checks: shards tokenized by another tokenizer are refused.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from brigade.errors import BrigadeError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# End-of-sequence tokens of common tokenizers (T5/Llama 2, GPT-2, Llama 3, Gemma, ChatML), in
# the order they are tried.
EOS_TOKENS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|im_end|>")


def tokenizer_file(directory: str) -> Path:
    """`DIR/tokenizer.json`, checked to exist.

    Raises:
        BrigadeError: no such directory, or no tokenizer.json in it.
    """
    file = Path(directory) / "tokenizer.json"
    if not Path(directory).is_dir():
        raise BrigadeError(f"model directory {directory!r} not found: give the folder that "
                           f"save_pretrained wrote, e.g. model.save_pretrained({directory!r})")
    if not file.is_file():
        raise BrigadeError(f"{str(file)!r} not found: the directory needs the tokenizer.json that "
                           f"save_pretrained writes, e.g. tokenizer.save_pretrained({directory!r})")
    return file


def load_tokenizer(directory: str) -> Tokenizer:
    """The tokenizer that `save_pretrained` wrote into a model directory.

    Args:
        directory: the folder of `--model hf:DIR`, holding `tokenizer.json`.

    Returns:
        The `tokenizers.Tokenizer` read from `DIR/tokenizer.json`.

    Raises:
        BrigadeError: the `tokenizers` package is missing, there is no `tokenizer.json`, or it
            cannot be read.
    """
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise BrigadeError("--model hf:... needs the 'tokenizers' package: pip install -e '.[hf]'") \
            from None
    file = tokenizer_file(directory)
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the library raises a bare Exception with the parser's message
        cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BrigadeError(f"{str(file)!r} is not a tokenizer file the tokenizers library can read "
                           f"({cause}): write it again with tokenizer.save_pretrained({directory!r})") \
            from None


def tokenizer_sha256(directory: str) -> str:
    """The SHA-256 of `DIR/tokenizer.json`'s bytes: the tokenizer's identity in a shard set."""
    return hashlib.sha256(tokenizer_file(directory).read_bytes()).hexdigest()


def find_eos(tokenizer: Tokenizer) -> int | None:
    """The id of the tokenizer's end-of-sequence token: the first of `EOS_TOKENS` it knows, else
    None."""
    for token in EOS_TOKENS:
        eos = tokenizer.token_to_id(token)
        if eos is not None:
            return eos
    return None
