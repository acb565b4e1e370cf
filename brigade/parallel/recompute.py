"""Activation recomputation: a block keeps little of its forward and runs it again in backward.

    none       autograd keeps every tensor a block's backward needs (the default)
    full       a block keeps its inputs (and its parameters, held anyway); the first time its
               backward needs a saved tensor, the block's forward runs again to make them all
    selective  as full, but the outputs of the expensive ops (matmuls, attention without
               dropout) are kept from the forward and replayed, so what runs again is the
               cheap rest (norms, activations, dropout, views)
    op         as selective, but of the matmuls only the first, third, fifth… of a block's call
               are kept: every second one runs again (torchtitan's "op" selective policy, which
               keeps attention and all but every second mm; in a Llama layer the key, output and
               w3 projections are made again)

Built, as torch.utils.checkpoint's non-reentrant mode is, on `saved_tensors_hooks`: a saved
tensor becomes a ticket into its block call's `_Frame`, which recomputes on the first ticket
redeemed. One difference is the reason this is brigade's own: the recomputed tensors stay in
the frame until autograd frees the graph that holds the tickets. torch's checkpoint keys what
it recomputes by the backward call (graph task), so a zero-bubble schedule's input pass (I) and
weight pass (W), two calls over one graph, would run every recomputed forward twice; here they
share one.

    forward:   block(x) ── each saved tensor t ──► a parameter or x: kept as it is
                                              └──► else: ticket (frame, i), t itself freed
    backward:  first ticket ──► frame.recompute(): forward again from x, same RNG state and
               autocast, saving every tensor in order (selective: kept op outputs replayed)
               every ticket ──► frame.saved[i], kept until the graph is freed (after W)

The random draws repeat because the frame restores the CPU (and the block's GPUs') generator
state; a kept op that draws (attention with dropout) is recomputed instead, so every draw
after it repeats too. Models know nothing of this: `apply` wraps blocks from outside (their
`forward`, so parameter names do not change) before any data-parallel wrapper, as torchtitan
orders it; a model file may set a mode per block (`models.ModelSpec.recompute`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from brigade.config.recompute import MODES
from brigade.errors import BrigadeError
from brigade.parallel import held

_aten = torch.ops.aten
# Ops whose outputs selective recompute keeps: matmuls and fused attention (torchtitan's policy
# keeps the same kinds); every other op runs again.
KEPT = {getattr(_aten, name) for name in (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu") if hasattr(_aten, name)}


MATMULS = {getattr(_aten, name) for name in ("mm", "addmm", "bmm", "baddbmm")}


def kept(func, args, kwargs) -> bool:
    """Whether selective recompute keeps this op's output: a kept kind that draws no random numbers
    (the planner counts what it keeps by this too, `planner.formula`)."""
    if func.overloadpacket not in KEPT:
        return False
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p":
            p = kwargs.get("dropout_p", args[i] if i < len(args) else arg.default_value)
            return not p
    return True


def _detached(out):
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)


class _Record(TorchDispatchMode):
    """In the first forward: note the output of every kept op, in order; under `every_second`
    ("op"), None in place of every second matmul's (made again)."""

    def __init__(self, outputs: list, every_second: bool = False):
        super().__init__()
        self.outputs, self.every_second, self.matmuls = outputs, every_second, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if kept(func, args, kwargs):
            self.matmuls += func.overloadpacket in MATMULS
            again = self.every_second and func.overloadpacket in MATMULS and self.matmuls % 2 == 0
            self.outputs.append(None if again else _detached(out))
        return out


class _Replay(TorchDispatchMode):
    """In the recompute: hand back each kept op's noted output instead of running it again (one
    noted None: run it again)."""

    def __init__(self, outputs: list):
        super().__init__()
        self.outputs = iter(outputs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kept(func, args, kwargs):
            noted = next(self.outputs)
            # A fresh alias: autograd sets the recompute's history on what an op returns, and the
            # noted tensor itself must not come to hold that graph.
            return func(*args, **kwargs) if noted is None else _detached(noted)
        return func(*args, **kwargs)


def _tensors(tree) -> list[torch.Tensor]:
    out: list = []
    tree_map(lambda t: out.append(t) if isinstance(t, torch.Tensor) else None, tree)
    return out


class _Frame:
    """One call of one block: what its recompute needs, and (once recomputed) the saved tensors.

    Args:
        forward: the block's own forward (not the module call: its hooks ran once).
        args, kwargs: the call's inputs, kept (the block's inputs are what recompute holds).
        selective: keep kept ops' outputs (`_Record`) and replay them in the recompute.
        name: the block, for messages.
    """

    def __init__(self, forward, args, kwargs, selective: bool, name: str):
        self.forward, self.args, self.kwargs, self.name = forward, args, kwargs, name
        self.inputs = {id(t) for t in _tensors((args, kwargs))}
        gpus = sorted({t.device for t in _tensors((args, kwargs)) if t.device.type == "cuda"}, key=str)
        self.rng = (torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in gpus])
        self.autocast = [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
                         for kind in ("cpu", "cuda") if kind == "cpu" or torch.cuda.is_available()]
        self.outputs: list | None = [] if selective else None
        self.tickets = 0  # tensors the first forward left to the recompute
        self.saved: list | None = None
        # What the frame holds instead of the saved tensors, counted while memory is measured.
        counting = held.current()
        self.holders = counting.keep(_tensors((args, kwargs))) if counting else []

    def keeps(self, t: torch.Tensor) -> bool:
        """A tensor saved as it is: a parameter (or a view of one), or one of the call's inputs
        (held anyway)."""
        return _keeps(t, self.inputs)

    def pack(self, t: torch.Tensor):
        if self.keeps(t):
            return t
        self.tickets += 1
        return (self, self.tickets - 1)

    def recompute(self) -> None:
        """Run the forward again as it first ran, keeping each tensor it saves (detached)."""
        _reruns[0] += 1
        saved: list = []
        inputs = self.inputs

        def pack(t):  # (not a method: the recompute's graph keeps its hooks, and must not keep the frame)
            if not _keeps(t, inputs):
                saved.append(t.detach())

        cpu, gpus = self.rng
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=[d for d, _ in gpus]))
            torch.set_rng_state(cpu)
            for d, state in gpus:
                torch.cuda.set_rng_state(state, d)
            for kind, on, dtype in self.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=on))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(saved_tensors_hooks(pack, _never))
            if self.outputs is not None:
                stack.enter_context(_Replay(self.outputs))
            self.forward(*self.args, **self.kwargs)
        if len(saved) != self.tickets:
            raise BrigadeError(f"{self.name} saved {self.tickets} tensors for backward when it ran and "
                               f"{len(saved)} when recomputed: its forward depends on more than its "
                               "inputs and parameters; turn recompute off for it (--recompute none, "
                               "or recompute = {index: 'none'} in the model file)")
        self.saved = saved
        counting = held.current()
        if counting:
            self.holders += counting.keep(saved)
        self.outputs = None


SELECTIVE = ("selective", "op")  # the modes that keep some ops' outputs (`_Record`)
_reruns = [0]  # forwards run again in this process, for `reruns`


def reruns() -> int:
    """How many block forwards have run again (recomputed) in this process so far: what a
    benchmark or a test counts, by the difference over what it runs."""
    return _reruns[0]


def _keeps(t: torch.Tensor, inputs: set[int]) -> bool:
    return held.is_parameter(t) or id(t) in inputs


def _never(_):
    raise AssertionError("a recompute's own saved tensors are never unpacked")


def _unpack(ticket):
    if not isinstance(ticket, tuple):
        return ticket
    frame, i = ticket
    if frame.saved is None:
        frame.recompute()
    return frame.saved[i]


class Recomputed:
    """A block's forward that keeps little and recomputes in backward; set as the block's `forward`.

    `forward`: the block's own (or any function of tensors and parameters: `recomputed`). In
    no-grad mode (evaluation) it runs as it is.
    """

    def __init__(self, forward, mode: str, name: str):
        self.inner, self.selective, self.name = forward, mode in SELECTIVE, name
        self.every_second = mode == "op"

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)
        frame = _Frame(self.inner, args, kwargs, self.selective, self.name)
        with contextlib.ExitStack() as stack:
            stack.enter_context(saved_tensors_hooks(frame.pack, _unpack))
            if frame.outputs is not None:
                stack.enter_context(_Record(frame.outputs, self.every_second))
            out = self.inner(*args, **kwargs)
        counting = held.current()
        if counting and frame.outputs:
            frame.holders += counting.keep(_tensors([o for o in frame.outputs if o is not None]))  # selective: kept until recomputed
        return out


def recomputed(fn, name: str) -> Recomputed:
    """`fn` made to keep only its inputs and run again in backward, as a block under full
    recompute (the chunked head's loss runs each chunk so: `parallel.chunked`). `name`: what it
    is, for messages."""
    return Recomputed(fn, "full", name)


def modes(blocks: list[nn.Module], mode: str) -> list[str]:
    """Each block's mode: `mode`, unless the block declares its own (`block.recompute`, which a
    model file's `recompute = {index: mode}` sets; see `brigade.models`).

    Raises:
        BrigadeError: an unknown mode, run-wide or declared by a block.
    """
    chosen = []
    for i, block in enumerate(blocks):
        m = getattr(block, "recompute", None) or mode
        if m not in MODES:
            where = "--recompute" if m == mode else f"block {i} ({type(block).__name__}) declares recompute"
            raise BrigadeError(f"{where} {m!r}: expected one of {', '.join(MODES)}")
        chosen.append(m)
    return chosen


def apply(blocks: list[nn.Module], mode: str, held: Iterable[int] | None = None) -> list[str]:
    """Set each block to recompute by its mode (`modes`), in place, before any data-parallel wrapper.

    Args:
        blocks: the whole model's blocks (a block's index names it in messages).
        mode: the run's mode; a block may declare its own.
        held: the indices of the blocks to set (those this process holds); None: all.

    Returns:
        each block's mode.
    """
    chosen = modes(blocks, mode)
    held = set(range(len(blocks)) if held is None else held)
    for i, (block, m) in enumerate(zip(blocks, chosen)):
        if i in held and m != "none" and not isinstance(block.forward, Recomputed):
            block.forward = Recomputed(block.forward, m, f"block {i} ({type(block).__name__})")
    return chosen
