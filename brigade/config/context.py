"""Context parallel's rules (`--cp`, `--cp-method`) that need no torch: what the configuration, the
check's preflight and the planner refuse before any process starts. What runs is
`parallel.context`."""

from __future__ import annotations

from brigade.errors import BrigadeError

METHODS = ("auto", "all-to-all", "ring")


def method_for(method: str, device_type: str) -> str:
    """The method `--cp-method` names on this device: auto is ring on CUDA, all-to-all elsewhere.

    Raises:
        BrigadeError: an unknown method, or ring where the device is not CUDA.
    """
    if method not in METHODS:
        raise BrigadeError(f"--cp-method {method!r}: expected one of {', '.join(METHODS)}")
    if method == "auto":
        return "ring" if device_type == "cuda" else "all-to-all"
    if method == "ring" and device_type != "cuda":
        raise BrigadeError(f"--cp-method ring on {device_type}: torch's ring attention runs on CUDA only "
                           "(its CPU attention kernel has no sharding strategy); use --cp-method all-to-all")
    return method


def check_length(length: int, cp: int, tp: int = 1, method: str = "all-to-all",
                 what: str = "--block-size") -> None:
    """Before a run: a sequence length the cut divides (C parts, 2C chunks under ring, each
    split again over tp by sequence parallel).

    Raises:
        BrigadeError: naming the length, what divides it, and a length that would.
    """
    pieces = cp * (2 if method == "ring" else 1) * tp
    if cp > 1 and length % pieces:
        how = f"--cp {cp}" + (" × 2 chunks (ring)" if method == "ring" else "")
        how += f" × --tp {tp}" if tp > 1 else ""
        raise BrigadeError(f"{what} {length} does not split into {how} = {pieces} equal parts: use a "
                           f"sequence length that {pieces} divides, like {(length // pieces + 1) * pieces}")


def check_heads(heads: int, kv_heads: int, cp: int, tp: int = 1, where: str = "the model") -> None:
    """Before a run, under all-to-all: the query heads a process holds (heads ÷ tp) split into C
    groups. Key/value heads that do not are repeated to the query heads, which always do then.

    Raises:
        BrigadeError: heads that C × tp does not divide.
    """
    if cp > 1 and heads % (cp * tp):
        by = f"--cp {cp}" + (f" × --tp {tp}" if tp > 1 else "")
        raise BrigadeError(f"{where} has {heads} attention heads, which {by} = {cp * tp} does not divide: "
                           f"all-to-all context parallel hands each process a C-th of its heads; use a --cp "
                           f"(× --tp) that divides {heads}, or --cp-method ring on GPUs")
    del kv_heads  # repeated where they do not split (module docstring)


def check_layout(cp: int, method: str, local_stages: int = 1, ep: int = 1, runtime: str = "process") -> None:
    """What --cp composes with, before any process starts (its degree ≥ 1 is checked with the
    others).

    Raises:
        BrigadeError: an unknown --cp-method; --cp with local stages (or --runtime local) or with
            --ep, one line each.
    """
    if method not in METHODS:
        raise BrigadeError(f"--cp-method {method!r}: expected one of {', '.join(METHODS)}")
    if cp <= 1:
        return
    if local_stages > 1 or runtime == "local":
        how = f"--local-stages {local_stages}" if local_stages > 1 else "--runtime local"
        raise BrigadeError(f"--cp {cp} with {how}: context parallel splits each sequence over processes of a "
                           "DeviceMesh, and local stages drive several devices from one process; pipeline "
                           "across processes (--pp) instead, or drop --cp")
    if ep > 1:
        raise BrigadeError(f"--cp {cp} with --ep {ep}: context parallel does not compose with expert "
                           "parallel yet; use one of them")


def refuse_documents(cp: int, fix: str = "add --no-document-mask (windows attend across documents)",
                     what: str = "document masks (on for an hf:DIR model's shard sets)") -> None:
    """Document masks (`models.documents`) with --cp > 1: refused. Each process holds a part of
    the sequence, and both methods take attention without a mask (the all-to-all could carry the
    whole sequence's documents to where every position meets, but does not yet; torch's ring
    over a document mask needs FlexAttention's, CUDA only, not wired here).

    Raises:
        BrigadeError: one line, naming `what` asked for the masks and `fix`, how to turn them off.
    """
    if cp > 1:
        raise BrigadeError(f"--cp {cp} with {what}: context parallel takes causal attention without a "
                           f"mask, which would let a window's documents attend to each other; {fix}, "
                           "or drop --cp")
