"""The wire format: what a tensor's header and a structure's description look like as int64s.

A transport between processes sends tensors whose dtype and shape the receiver must know
before it can post the receive: `encode_header` makes that a fixed-length int64 list. A
structure (`stages.structure.Spec`) travels, when it changes, as the int64 list `encode`
makes, version first, so two ranks running different brigade versions refuse each other's
messages in one line instead of misreading them. Pure bookkeeping: no communication here.
"""

from __future__ import annotations

import torch

from brigade.pipeline.stages.structure import Spec, StructureError

VERSION = 1


_CODES = {"T": 0, "None": 1, "bool": 2, "int": 3, "float": 4, "str": 5,
          "tuple": 6, "list": 7, "dict": 8, "namedtuple": 9}


_KINDS = {code: kind for kind, code in _CODES.items()}


def encode(spec: Spec) -> list[int]:
    """The description as int64 values (version first), for a transport to send as one tensor.
    Raises StructureError for an int value outside int64."""
    out = [VERSION]
    _encode(spec, out)
    return out


def _encode_str(s: str, out: list[int]) -> None:
    out.append(len(s))
    out.extend(map(ord, s))


def _encode(spec: Spec, out: list[int]) -> None:
    out.append(_CODES[spec.kind])
    if spec.kind in ("bool", "int", "float"):
        if not -(2**63) <= int(spec.value) < 2**63:
            raise StructureError(f"the int {spec.value} does not fit in 64 bits: send it as a str")
        out.append(int(spec.value))
    elif spec.kind == "str":
        _encode_str(spec.value, out)
    elif spec.kind in ("tuple", "list", "dict", "namedtuple"):
        if spec.kind == "namedtuple":
            _encode_str(spec.type_name, out)
        out.append(len(spec.children))
        for i, child in enumerate(spec.children):
            if spec.keys:
                _encode_str(spec.keys[i], out)
            _encode(child, out)


def decode(codes: list[int]) -> Spec:
    """The inverse of `encode`. Raises StructureError for codes it did not make (another version)."""
    codes = [int(c) for c in codes]
    if not codes or codes[0] != VERSION:
        raise StructureError(f"structure description version {codes[:1]}: expected [{VERSION}]; "
                             "run the same brigade version on every rank")
    try:
        spec, end = _decode(codes, 1)
        if end != len(codes):
            raise ValueError("values left over")
    except (IndexError, KeyError, ValueError):
        raise StructureError(f"a structure description of {len(codes)} values arrived damaged: "
                             "every rank must run the same brigade version") from None
    return spec


def _decode_str(codes: list[int], i: int) -> tuple[str, int]:
    n = codes[i]
    return "".join(map(chr, codes[i + 1:i + 1 + n])), i + 1 + n


def _decode(codes: list[int], i: int) -> tuple[Spec, int]:
    kind = _KINDS[codes[i]]
    i += 1
    if kind in ("T", "None"):
        return Spec(kind), i
    if kind in ("bool", "int", "float"):
        return Spec(kind, value=bool(codes[i]) if kind == "bool" else codes[i]), i + 1
    if kind == "str":
        s, i = _decode_str(codes, i)
        return Spec("str", value=s), i
    type_name = ""
    if kind == "namedtuple":
        type_name, i = _decode_str(codes, i)
    n, i = codes[i], i + 1
    keys, kids = [], []
    for _ in range(n):
        if kind in ("dict", "namedtuple"):
            key, i = _decode_str(codes, i)
            keys.append(key)
        kid, i = _decode(codes, i)
        kids.append(kid)
    return Spec(kind, tuple(kids), tuple(keys), type_name=type_name), i


_DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]


_MAX_DIMS = 8


HEADER_LEN = 2 + _MAX_DIMS  # int64 elements of an encoded header


def encode_header(t: torch.Tensor) -> list[int]:
    """[dtype code, ndim, *shape, 0-padding] — what the receiver needs to allocate."""
    if t.dim() > _MAX_DIMS:
        raise ValueError(f"cannot send a {t.dim()}-dimensional tensor: at most {_MAX_DIMS} dims")
    return [_DTYPES.index(t.dtype), t.dim(), *t.shape, *([0] * (_MAX_DIMS - t.dim()))]


def decode_header(header: list[int]) -> tuple[torch.dtype, tuple[int, ...]]:
    code, ndim = header[0], header[1]
    return _DTYPES[code], tuple(header[2 : 2 + ndim])
