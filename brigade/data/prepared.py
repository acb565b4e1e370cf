"""What `--data` becomes for a model with a tokenizer (`--model hf:DIR`): training and validation
windows read from a shard set.

- a folder with a `manifest.json` (`brigade tokenize` wrote it): read as it is, its tokenizer
  checked against the model's;
- anything else (a text file, JSON Lines, Parquet, a folder of them, or nothing: the built-in
  corpus): tokenized first into a cache beside the run, `OUT/tokens/`, by the same code as
  `brigade tokenize`, in bounded memory; again only when its inputs change. The processes of a
  machine take turns on a lock, so one of them tokenizes and the others find it done.
"""

from __future__ import annotations

import fcntl
from contextlib import contextmanager
from pathlib import Path

from brigade.data.shards import MANIFEST, ShardSet, TokenWindows, split
from brigade.data.tokenize import TokenizeConfig, tokenize
from brigade.data.tokenizer import tokenizer_sha256

CACHE = "tokens"  # the cache's folder in a run's --out


def is_shard_set(data: str) -> bool:
    return bool(data) and (Path(data) / MANIFEST).is_file()


def token_data(data: str, directory: str, block_size: int, val_fraction: float,
               out: str) -> tuple[ShardSet, TokenWindows, TokenWindows]:
    """The shard set `--data` names or becomes, and its training and validation windows.

    Args:
        data: `--data`: a shard set, a corpus to tokenize into `out/tokens`, or "" (built in).
        directory: the model directory (its tokenizer.json).
        block_size, val_fraction: as `shards.split`.
        out: the run's folder, where an unprepared corpus is cached.

    Raises:
        BrigadeError: as `tokenize.tokenize`, `ShardSet.open` and `shards.split`.
    """
    if is_shard_set(data):
        folder = Path(data)
    else:
        folder = Path(out) / CACHE
        with _lock(folder):
            tokenize(TokenizeConfig(corpus=[data], model=f"hf:{directory}", out=str(folder)),
                     progress=False, verify=False, say=lambda line: None)
    shards = ShardSet.open(folder, tokenizer_sha256(directory))
    train, val = split(shards, block_size, val_fraction)
    return shards, train, val


@contextmanager
def _lock(folder: Path):
    """This machine's processes one at a time (a file lock beside the folder)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
