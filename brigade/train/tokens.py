"""Token-level text data for Hugging Face models (`--model hf:DIR --data PATH`).

The tokenizer is the `tokenizer.json` that `save_pretrained` writes into DIR, read with the
`tokenizers` library (the optional `hf` extra), so the ids are the model's own.

Format: `--data` is a UTF-8 text file, the whole of it one document, or, when its name ends
in `.jsonl` or `.json`, JSON Lines: each non-empty line an object with a string field
`text`, one document each (`{"text": "..."}`; other fields are ignored).

Packing: each document is tokenized without special tokens and the documents are joined
into one stream of ids, the tokenizer's end-of-sequence token between them when it has one
(`</s>`, `<|endoftext|>`, ...), so the model sees where one text ends and the next begins:

    doc 0: a b c      doc 1: d e      stream: a b c </s> d e

Sampling: example k is the window of block_size + 1 ids starting at k * block_size, so the
windows tile the stream (each id is a target once per epoch), unlike the character windows
of `text.CharDataset`, which start at every position. The same `Sampler` draws them.

Split: the validation set is the last `val_fraction` of the packed stream, cut at a fixed
token position as `data.load_text_data` cuts characters; the training set is the rest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from brigade.errors import BrigadeError
from brigade.train.text import CharDataset, read_text

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# End-of-sequence tokens of common tokenizers (T5/Llama 2, GPT-2, Llama 3, Gemma, ChatML), in
# the order they are tried.
EOS_TOKENS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|im_end|>")
JSON_LINES_SUFFIXES = (".jsonl", ".json")


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
    file = Path(directory) / "tokenizer.json"
    if not Path(directory).is_dir():
        raise BrigadeError(f"model directory {directory!r} not found: give the folder that "
                           f"save_pretrained wrote, e.g. model.save_pretrained({directory!r})")
    if not file.is_file():
        raise BrigadeError(f"{str(file)!r} not found: the directory needs the tokenizer.json that "
                           f"save_pretrained writes, e.g. tokenizer.save_pretrained({directory!r})")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the library raises a bare Exception with the parser's message
        cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BrigadeError(f"{str(file)!r} is not a tokenizer file the tokenizers library can read "
                           f"({cause}): write it again with tokenizer.save_pretrained({directory!r})") \
            from None


def find_eos(tokenizer: Tokenizer) -> int | None:
    """The id of the tokenizer's end-of-sequence token: the first of `EOS_TOKENS` it knows, else
    None."""
    for token in EOS_TOKENS:
        eos = tokenizer.token_to_id(token)
        if eos is not None:
            return eos
    return None


def read_documents(path: str, field: str = "text") -> list[str]:
    """The documents of a `--data` file: the whole of a text file, or one per JSON Lines object.

    Args:
        path: a UTF-8 text file; JSON Lines when it ends in `.jsonl` or `.json`.
        field: the string field of each JSON object that holds its text.

    Returns:
        The documents, in file order; JSON objects with an empty text are left out.

    Raises:
        BrigadeError: the file is missing, empty or not text (as `text.read_text`), or a JSON
            line is not valid JSON, not an object, or has no string `field`; or no line has text.
    """
    text = read_text(path)
    if not path.endswith(JSON_LINES_SUFFIXES):
        return [text]
    docs = []
    # Split on "\n" only: str.splitlines would also cut at U+2028, which JSON allows in a string.
    for number, line in enumerate(text.removeprefix("\ufeff").split("\n"), start=1):
        if line.strip():
            doc = _document(line, path, number, field)
            if doc:
                docs.append(doc)
    if not docs:
        raise BrigadeError(f"--data {path!r} has no documents: every line's {field!r} is empty; "
                           f"give lines like {{\"{field}\": \"...\"}} with text in them")
    return docs


def _document(line: str, path: str, number: int, field: str) -> str:
    """The text of one JSON line, or a BrigadeError naming the file and the line."""
    example = f"each line must be like {{\"{field}\": \"...\"}}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise BrigadeError(f"--data {path!r} line {number} is not valid JSON ({exc.msg}, column "
                           f"{exc.colno}): {example}") from None
    if not isinstance(obj, dict):
        raise BrigadeError(f"--data {path!r} line {number} is a JSON {type(obj).__name__}, not an "
                           f"object: {example}")
    value = obj.get(field)
    if not isinstance(value, str):
        raise BrigadeError(f"--data {path!r} line {number} has no string field {field!r}: {example}")
    return value


def pack(docs: list[list[int]], eos: int | None) -> torch.Tensor:
    """One stream of ids: the documents' ids in order, `eos` between documents unless None.

    Args:
        docs: each document's token ids.
        eos: the end-of-sequence id put between two documents (not after the last), or None.

    Returns:
        A 1-D int64 tensor.
    """
    stream: list[int] = []
    for i, ids in enumerate(docs):
        if i and eos is not None:
            stream.append(eos)
        stream.extend(ids)
    return torch.tensor(stream, dtype=torch.long)


class TokenDataset(CharDataset):
    """Packed sequences: example k is ids[k*T : k*T + T + 1], inputs and next-token targets.

    Works wherever `text.CharDataset` does (`len`, `batch(indices) -> (inputs, targets)`); its
    windows tile the stream (stride None: the block size) instead of starting everywhere.
    """

    unit, piece, stride = "tokens", "sequence", None

    def __init__(self, ids: torch.Tensor, block_size: int, what: str = "--data"):
        super().__init__(ids, block_size, what)


def load_token_data(path: str, directory: str, block_size: int,
                    val_fraction: float) -> tuple[Tokenizer, TokenDataset, TokenDataset]:
    """The tokenizer, and train / validation sets split at a fixed token position.

    Args:
        path: the `--data` file (see `read_documents`).
        directory: the model directory holding `tokenizer.json` (see `load_tokenizer`).
        block_size: the training sequence length in tokens.
        val_fraction: the share of the packed stream, at its end, held out for validation.

    Returns:
        (tokenizer, train, validation).

    Raises:
        BrigadeError: as `load_tokenizer` and `read_documents`, or too few tokens for one
            sequence in the whole text, its training part or its validation part.
    """
    tokenizer = load_tokenizer(directory)
    docs = read_documents(path)
    encodings = tokenizer.encode_batch(docs, add_special_tokens=False)
    ids = pack([e.ids for e in encodings], find_eos(tokenizer))
    if len(ids) < block_size + 1:
        raise BrigadeError(
            f"--data {path!r} has {len(ids)} tokens, fewer than one sequence of {block_size} + 1: "
            "use more text or a smaller --block-size"
        )
    cut = int(len(ids) * (1 - val_fraction))
    train = TokenDataset(ids[:cut], block_size, "training part of --data")
    val = TokenDataset(ids[cut:], block_size, "validation part of --data")
    return tokenizer, train, val
