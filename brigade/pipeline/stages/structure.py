"""Structures of tensors between blocks: flatten to (tensors, Spec), send, unflatten.

A block may take and return a tensor, or a (nested) tuple, list, dict with str keys or
namedtuple of tensors, with int, float, bool, None and str values passing through unchanged.
`flatten` separates the tensors from the description (`Spec`); the description is hashable,
so a transport sends it only when it changes, as the int64 list `transport.wire.encode` makes.

    tensors, spec = flatten({"x": h, "cache": (k, 3)})   # [h, k], the dict without h and k
    unflatten(tensors, spec)                              # {"x": h, "cache": (k, 3)} again

Backward across a boundary (`as_inputs`, `input_grads`, `backward_pairs`) is `boundary.py`;
the description's wire format, `transport/wire.py`.
"""

from __future__ import annotations

import importlib
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from brigade.errors import BrigadeError

_VALUES = (type(None), bool, int, float, str)
_NAMEDTUPLES: dict[str, type] = {}  # classes this process flattened, for types not importable
_HELP = ("a block may pass tensors in tuples, lists, dicts with str keys and namedtuples, "
         "and int, float, bool, None or str values")


class StructureError(BrigadeError):
    """A structure that cannot be sent, or that does not match the one expected."""


@dataclass(frozen=True)
class Spec:
    """The description of a structure without its tensors: hashable, comparable.

    kind: "T" (a tensor), a value ("None", "bool", "int", "float", "str") or a container ("tuple",
    "list", "dict", "namedtuple"); `value` a value leaf's value (a float's bits); `keys` a dict's
    keys or a namedtuple's fields; `type_name` a namedtuple's "module:qualname".
    """

    kind: str
    children: tuple[Spec, ...] = ()
    keys: tuple[str, ...] = ()
    value: Any = None
    type_name: str = ""

    @property
    def n_tensors(self) -> int:
        """How many tensors a structure with this description holds."""
        return 1 if self.kind == "T" else sum(c.n_tensors for c in self.children)


TENSOR = Spec("T")


def _float_bits(x: float) -> int:  # equal descriptions then mean identical values (nan included)
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _bits_float(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", b))[0]


def child_path(path: str, kind: str, key: Any) -> str:
    return f"{path}.{key}" if kind == "namedtuple" else f"{path}[{key!r}]"


def flatten(obj: Any, root: str = "output",
            is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], Spec]:
    """Split a structure into its tensors (depth first, in order) and its description.

    Args:
        obj: a tensor or a structure of tensors and values.
        root: how error messages name `obj` (e.g. "output" gives `output['cache'][1]`).
        is_leaf: objects for which it returns True are taken as tensor slots too.

    Returns:
        (tensors, spec) with `unflatten(tensors, spec)` rebuilding `obj`.

    Raises:
        StructureError: a leaf that cannot be sent, naming its path and type.
    """
    if isinstance(obj, torch.Tensor):  # the common case, without recursion
        return [obj], TENSOR
    tensors: list[Any] = []
    return tensors, _flatten(obj, root, tensors, is_leaf)


def _flatten(obj: Any, path: str, out: list, is_leaf) -> Spec:
    if isinstance(obj, torch.Tensor) or (is_leaf is not None and is_leaf(obj)):
        out.append(obj)
        return TENSOR
    if isinstance(obj, _VALUES):
        kind = _value_kind(obj)
        return Spec(kind, value=_float_bits(obj) if kind == "float" else obj)
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
        cls = type(obj)
        name = f"{cls.__module__}:{cls.__qualname__}"
        _NAMEDTUPLES[name] = cls
        kids = tuple(_flatten(v, f"{path}.{f}", out, is_leaf) for f, v in zip(cls._fields, obj))
        return Spec("namedtuple", kids, tuple(cls._fields), type_name=name)
    if isinstance(obj, (tuple, list)):
        kind = "tuple" if isinstance(obj, tuple) else "list"
        return Spec(kind, tuple(_flatten(v, f"{path}[{i}]", out, is_leaf) for i, v in enumerate(obj)))
    if isinstance(obj, dict):
        bad = next((k for k in obj if not isinstance(k, str)), None)
        if bad is not None:
            raise StructureError(f"{path} has the key {bad!r} ({type(bad).__name__}): "
                                 "dict keys must be str; use str keys")
        kids = tuple(_flatten(v, f"{path}[{k!r}]", out, is_leaf) for k, v in obj.items())
        return Spec("dict", kids, tuple(obj))
    raise StructureError(f"{path} is a {type(obj).__module__}.{type(obj).__qualname__}, which cannot "
                         f"be sent: {_HELP}; return one of those")


def _value_kind(obj: Any) -> str:
    """A subclass of a value type (an IntEnum...) is sent as its base type."""
    if obj is None:
        return "None"
    return next(t.__name__ for t in (bool, int, float, str) if isinstance(obj, t))


def unflatten(tensors: list[Any], spec: Spec) -> Any:
    """Rebuild the structure `spec` describes, taking `tensors` in order (None entries allowed).

    Raises:
        StructureError: the number of tensors differs from `spec.n_tensors`, or a namedtuple's
            class cannot be found in this process.
    """
    if len(tensors) != spec.n_tensors:
        raise StructureError(f"got {len(tensors)} tensors for a structure that holds "
                             f"{spec.n_tensors}: send every tensor flatten() returned")
    return _build(spec, iter(tensors))


def _build(spec: Spec, it) -> Any:
    kind = spec.kind
    if kind == "T":
        return next(it)
    if kind in ("None", "bool", "int", "float", "str"):
        return _bits_float(spec.value) if kind == "float" else spec.value
    kids = [_build(c, it) for c in spec.children]
    if kind in ("tuple", "list"):
        return tuple(kids) if kind == "tuple" else kids
    return dict(zip(spec.keys, kids)) if kind == "dict" else _namedtuple(spec.type_name)(*kids)


def _namedtuple(name: str) -> type:
    if name not in _NAMEDTUPLES:
        module, _, qualname = name.partition(":")
        try:
            cls: Any = importlib.import_module(module)
            for part in qualname.split("."):
                cls = getattr(cls, part)
        except (ImportError, AttributeError):
            raise StructureError(f"namedtuple {name} cannot be imported in this process: define it "
                                 "at the top level of an importable module") from None
        _NAMEDTUPLES[name] = cls
    return _NAMEDTUPLES[name]


def first_difference(a: Spec, b: Spec, root: str = "output") -> str | None:
    """The path of the first place where two descriptions differ (None if equal), for messages."""
    if a == b:
        return None
    if a.kind != b.kind or a.keys != b.keys or len(a.children) != len(b.children) or not a.children:
        return root
    for i, (x, y) in enumerate(zip(a.children, b.children)):
        where = first_difference(x, y, child_path(root, a.kind, a.keys[i] if a.keys else i))
        if where is not None:
            return where
    return root


def describe(obj: Any, limit: int = 4) -> str:
    """A short picture of a structure for error messages: `tuple(Tensor(4, 8) float32, 3)`."""
    if isinstance(obj, torch.Tensor):
        return f"Tensor({', '.join(map(str, obj.shape))}) {str(obj.dtype).removeprefix('torch.')}"
    if isinstance(obj, dict):
        items = [f"{k}: {describe(v, limit)}" for k, v in list(obj.items())[:limit]]
    elif isinstance(obj, (tuple, list)):
        items = [describe(v, limit) for v in list(obj)[:limit]]
    else:
        return repr(obj) if isinstance(obj, _VALUES) else type(obj).__name__
    more = ", …" if len(obj) > limit else ""
    return f"{type(obj).__name__}({', '.join(items)}{more})"
