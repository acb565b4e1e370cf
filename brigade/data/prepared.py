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
import hashlib
from contextlib import contextmanager
from pathlib import Path

from brigade.data import mix
from brigade.data.mix import Mixture
from brigade.data.shards import MANIFEST, ShardSet, TokenWindows, split
from brigade.data.tokenize import TokenizeConfig, tokenize
from brigade.data.tokenizer import tokenizer_sha256

CACHE = "tokens"  # the cache's folder in a run's --out
VAL_CACHE = "tokens-val"  # --val-data's, when it is a corpus


def is_shard_set(data: str) -> bool:
    return bool(data) and (Path(data) / MANIFEST).is_file()


def token_data(data: str, directory: str, block_size: int, val_fraction: float,
               out: str, val_data: str = "", val_flag: str = "--val-data", documents: bool = False) -> tuple[
        list[ShardSet], TokenWindows | Mixture, TokenWindows | Mixture]:
    """The shard sets `--data` names or becomes, and their training and validation windows: the
    stream's last `val_fraction` held out; or, given `val_data` (--val-data: a shard set or a
    corpus, tokenized into `out/tokens-val`), all of `data` to train on and that to validate on.
    `data` may name several corpora by weight (`a.txt:0.7,b:0.3`, `data.mix`): each is a shard
    set (or tokenized into `out/tokens-K`, K its place in the list) split as one would be, and
    the parts are mixed by the weights.

    Args:
        data: `--data`: a shard set, a corpus to tokenize into `out/tokens`, or "" (built in).
        directory: the model directory (its tokenizer.json).
        block_size, val_fraction: as `shards.split`.
        out: the run's folder, where an unprepared corpus is cached.
        val_flag: the option that named `val_data`, for an error's line.
        documents: the windows' batches say where their documents start (`shards.TokenWindows`).

    Raises:
        BrigadeError: as `tokenize.tokenize`, `ShardSet.open` and `shards.split` (either set
            shorter than one sequence); a mixture `mix.parse` refuses.
    """
    corpora = mix.parse(data)
    named = corpora or [(data, 1.0)]
    caches = [Path(out) / (CACHE if corpora is None else f"{CACHE}-{k}") for k in range(len(named))]
    sets = [_shard_set(path, directory, cache) for (path, _), cache in zip(named, caches)]
    if val_data:
        parts = [(TokenWindows(s, 0, len(s), block_size, "--data", documents), None) for s in sets]
        val = _held_out(val_data, directory, block_size, out, val_flag, documents)
    else:
        parts = [split(s, block_size, val_fraction, documents) for s in sets]
        val = None
    if corpora is None:
        return sets, parts[0][0], val or parts[0][1]
    weights = [w for _, w in corpora]
    return sets, Mixture([t for t, _ in parts], weights), val or Mixture([v for _, v in parts], weights)


def _held_out(val_data: str, directory: str, block_size: int, out: str, val_flag: str, documents: bool):
    """--val-data's windows (`val_flag`'s): one shard set or corpus, tokenized into OUT/tokens-val;
    several mixed by weight, corpus K's into OUT/tokens-val-K; with their `documents` (as
    `TokenWindows`)."""
    corpora = mix.parse(val_data, val_flag)
    named = corpora or [(val_data, 1.0)]
    parts = []
    for k, (path, _) in enumerate(named):
        held = _shard_set(path, directory, Path(out) / (VAL_CACHE if corpora is None else f"{VAL_CACHE}-{k}"))
        parts.append(TokenWindows(held, 0, len(held), block_size, f"held-out set {path!r} ({val_flag})",
                                  documents))
    return parts[0] if corpora is None else Mixture(parts, [w for _, w in corpora])


def content_sha256(sets: list[ShardSet]) -> str:
    """One digest of the ids in `sets` (one set's own `content_sha256`; a mixture's, of theirs in
    order), which a run's snapshots keep."""
    if len(sets) == 1:
        return sets[0].manifest.content_sha256()
    return hashlib.sha256(" ".join(s.manifest.content_sha256() for s in sets).encode()).hexdigest()


def _shard_set(data: str, directory: str, cache: Path) -> ShardSet:
    """`data` itself where it is a shard set, else the corpus tokenized into `cache` (once a
    machine: a file lock beside it)."""
    folder = Path(data) if is_shard_set(data) else cache
    if not is_shard_set(data):
        with _lock(folder):
            tokenize(TokenizeConfig(corpus=[data], model=f"hf:{directory}", out=str(folder)),
                     progress=False, verify=False, say=lambda line: None)
    return ShardSet.open(folder, tokenizer_sha256(directory))


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
