"""What one P2P message carries: a tensor, or a structure's tensors and, when it must travel,
the structure's description. Pure bookkeeping for `p2p.P2PTransport`: no communication here.

A message's `MessageLayout` is its `structure.Spec` and each tensor's (dtype, shape). The receiver
knows it either from the previous step (predicted) or from what precedes the payload:

    meta  int64[META_LEN], fixed size, so it can be received before anything is known:
          [SAME]                   as predicted (eager policy only)
          [0, *tensor header]      one plain tensor: its header inline, nothing more
          [n]                      a structure: a description of n int64 follows
    desc  [len(codes), *wire.encode(spec), *one tensor header per tensor]
    payload  the tensors, in `structure.flatten` order

A plain tensor thus costs what it cost before structures (header, payload); a structure adds
the description, as one more exchange of the same messages between the same ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from brigade.pipeline.stages import structure
from brigade.pipeline.transport import wire
from brigade.pipeline.transport.wire import HEADER_LEN, decode_header, encode_header

Shape = tuple[torch.dtype, tuple[int, ...]]
MessageLayout = tuple[structure.Spec, tuple[Shape, ...]]
META_LEN = 1 + HEADER_LEN
SAME = -1  # meta[0]: the layout the receiver predicted


def layout_of(obj: Any) -> tuple[list[torch.Tensor], MessageLayout]:
    """The tensors to send (detached, contiguous) and the layout that describes them.

    Raises:
        StructureError: `obj` holds something that cannot be sent (naming where).
    """
    tensors, spec = structure.flatten(obj)
    tensors = [t.detach().contiguous() for t in tensors]
    return tensors, (spec, tuple((t.dtype, tuple(t.shape)) for t in tensors))


def key_of(obj: Any) -> MessageLayout:
    """The layout of `obj` without copying anything (for comparing steps)."""
    tensors, spec = structure.flatten(obj)
    return spec, tuple((t.dtype, tuple(t.shape)) for t in tensors)


def build(tensors: list[torch.Tensor], layout: MessageLayout) -> Any:
    """The received object: a tensor, or the structure rebuilt around the tensors."""
    return structure.unflatten(tensors, layout[0])


def plain(layout: MessageLayout) -> bool:
    """A single tensor, described inline by the meta header (no description to send)."""
    return layout[0] == structure.TENSOR


def _tensor_header(shape: Shape) -> list[int]:
    return encode_header(torch.empty(shape[1], dtype=shape[0], device="meta"))


def meta(layout: MessageLayout, same: bool = False) -> list[int]:
    """The fixed-size header announcing a message (see the module docstring)."""
    if same:
        return [SAME] + [0] * HEADER_LEN
    if plain(layout):
        return [0, *_tensor_header(layout[1][0])]
    return [len(describe(layout))] + [0] * HEADER_LEN


def describe(layout: MessageLayout) -> list[int]:
    """The description that follows a structure's meta header."""
    codes = wire.encode(layout[0])
    return [len(codes), *codes, *(v for s in layout[1] for v in _tensor_header(s))]


def read_meta(values: list[int]) -> MessageLayout | int | None:
    """A received meta header: the layout of a plain tensor, a description's length, or None (SAME)."""
    if values[0] == SAME:
        return None
    if values[0] == 0:
        return structure.TENSOR, (decode_header(values[1:]),)
    return values[0]


def read_description(values: list[int]) -> MessageLayout:
    """The layout from a received description.

    Raises:
        StructureError: a description this version did not make.
    """
    n = values[0]
    spec = wire.decode(values[1:1 + n])
    rest = values[1 + n:]
    shapes = tuple(decode_header(rest[i:i + HEADER_LEN]) for i in range(0, len(rest), HEADER_LEN))
    if len(shapes) != spec.n_tensors:
        raise structure.StructureError(f"a structure description lists {len(shapes)} tensors for "
                                       f"{spec.n_tensors} slots: run the same brigade version on every rank")
    return spec, shapes


def buffers(layout: MessageLayout, device: torch.device, zeros: bool = False) -> list[torch.Tensor]:
    """Receive buffers (or zero placeholders) for a layout's tensors."""
    make = torch.zeros if zeros else torch.empty
    return [make(shape, dtype=dtype, device=device) for dtype, shape in layout[1]]


def show(layout: MessageLayout | None) -> str:
    """A layout for messages: `tuple(float32 (4, 8), int64 (4,))`."""
    if layout is None:
        return "nothing"
    pictures = [torch.empty(s, dtype=d, device="meta") for d, s in layout[1]]
    return structure.describe(structure.unflatten(pictures, layout[0]))
