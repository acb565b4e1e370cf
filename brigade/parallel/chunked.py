"""Chunked cross-entropy for the head: the last block's logits made and dropped a chunk of the
sequence at a time, inside the loss.

The head's loss is where a language model's memory peaks: at vocabulary V = 128 256 and a
sequence of 4096 its fp32 logits are 2 GiB a sample, and the backward holds them, their softmax
and their gradient at once. A position-wise head (a final norm and the output layer: each
position's logits depend on that position alone, `per_position = True` on the block) can be run
inside the loss instead, on one chunk of positions at a time, each chunk recomputed in backward
(`recompute.recomputed`), so the step holds one chunk's logits, not the sequence's.

    stage:  … ─ block n-1 ─ head (x as it is) ─► x ─► loss
    loss:   head(x, target) ─ for each chunk of positions:  head's forward ─ loss_fn ─ × tokens
                              (recomputed in backward)  ─► Σ ÷ the target's tokens

The model does not change: the head stays in its stage, but a call from the stage passes its
input on where the loss will run it (`_Deferring`), and the loss calls the real head as a module,
once a micro-batch, with the target: its forward is the chunk loop (`_HeadForward`). Calling the
module keeps every hook its wrappers put on it working: FSDP2's gather before it and reduce-scatter after its
backward, DDP's gradient hooks (the head is still the stage's, under its wrapper), tensor
parallel's on the head's own layers. Each chunk's loss is the model's own loss function on that
chunk (through `vocab.split_loss` under tp, whose "vocab" head leaves logits split: the chunk's
logits are), weighted by its tokens that count, and the sum divided by the target's: the mean
over the sequence's tokens, not a mean of the chunks' means, however the ignored targets
(IGNORE) fall.

Where it runs (`Chunked.defers`, decided by the stage's forward on the head's input, per
micro-batch): with a gradient only, where it helps (`helps`: a micro-batch's logits of at least
`THRESHOLD` elements, over more than one chunk; "on": more than one chunk). Elsewhere the head
runs in the stage as it always did: under no_grad (evaluation, inference: a pipeline's outputs
are logits), and for tiny models, whose runs do not change. It is off under schedules that
split the backward into I and W (zb, zbv, dualpipev): the weight pass keeps every chunk's logit
gradient until W, so a chunked head would hold what the plain one holds, and run its forward
twice. (An `auto` schedule is judged by its plan when the pipeline
is built.) Under FSDP2 a head left to the stage's root (tied to the embedding on one stage) keeps
the root gathered from the forward to its backward (`install`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from brigade.errors import BrigadeError
from brigade.parallel import recompute

IGNORE = -100  # a target the loss skips (torch's cross-entropy's and transformers' ignore index)
THRESHOLD = 1 << 26  # auto: logits of a micro-batch of ≥ 64 Mi elements (256 MiB in fp32) chunk


def helps(batch: int, positions: int, vocab: int) -> bool:
    """Whether chunking the head's loss saves memory worth a second forward of the head (about a
    third more of the head's compute): a micro-batch's logits of at least `THRESHOLD` elements."""
    return batch * positions * vocab >= THRESHOLD


class Chunked:
    """The chunked head of one last stage: how it runs, and the loss that runs it.

    Args:
        head: the model's last block (position-wise); its forward is replaced (`_HeadForward`).
        chunk: positions a chunk holds (of this process's part of the sequence).
        mode: "auto" (where `helps`) or "on" (whenever a sequence spans two chunks).
        autocast: the dtype the stages' forwards run under (None: none): the head's too.
        parts: under sequence parallel, the tp processes whose parts of the sequence the head
            gathers (its input is this process's part); 1: the head takes whole sequences.
        vocab_parts: the tp processes a "vocab" head splits its logits over (1: none): what
            `helps` counts is the logits a process holds.
    """

    def __init__(self, head: nn.Module, chunk: int, mode: str = "auto",
                 autocast: torch.dtype | None = None, parts: int = 1, vocab_parts: int = 1):
        if chunk < 1:
            raise BrigadeError(f"--loss-chunk {chunk}: must be ≥ 1 positions")
        self.head, self.chunk, self.mode, self.autocast, self.parts = head, chunk, mode, autocast, parts
        self.vocab = vocab(head) // vocab_parts  # this process's logits per position
        self.on = False  # set per pipeline (`Assembly.pipeline`): off under a split backward
        self.waiting = False  # the stage's last forward left the head to the loss
        self.last = 0  # the chunks the last loss ran in, 0 where the stage ran the head (`brigade check`)
        self.loss_fn = None
        inner = head.forward
        if isinstance(inner, recompute.Recomputed):  # each chunk is recomputed already
            inner = inner.inner
        head.forward = _HeadForward(inner, self)

    def defers(self, x: torch.Tensor) -> bool:
        """Whether the stage leaves the head to the loss for its input `x`: a forward that builds
        a graph, under a pipeline that chunks (`on`), where chunks help (`chunks`)."""
        return self.on and torch.is_grad_enabled() and self.chunks(x) > 1

    def loss(self, loss_fn):
        """`loss_fn` (logits, target) -> mean, made to run the head where the stage's forward left it
        (`_Deferring`): the pipeline computes a micro-batch's loss right after the last stage's
        forward, in the same thread, so the stage's last forward is the one this output is of."""
        self.loss_fn = loss_fn

        def loss(y, target):
            if not self.waiting:
                return loss_fn(y, target)
            self.waiting = False
            return self.head(y, target)
        loss.__wrapped__ = loss_fn
        return loss

    def chunks(self, x: torch.Tensor) -> int:
        """How many chunks the loss of `x` (B, T, C) runs in: 1 where chunking does not help."""
        b, t = x.shape[0], x.shape[1]
        n = -(-t // self.chunk)
        return n if self.mode == "on" or helps(b, t * self.parts, self.vocab) else 1


class _HeadForward:
    """The head's forward: its own on `x` alone (logits), the chunked loss given a target."""

    def __init__(self, inner, chunked: Chunked):
        self.inner, self.chunked = inner, chunked

    def __call__(self, x: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        if target is None:
            return self.inner(x)
        c = self.chunked
        c.last = c.chunks(x)
        if c.last == 1:
            return self._piece(x, target, count=False)
        run = recompute.recomputed(self._piece, "the head's loss chunk")
        total = None
        for xs, ts in zip(x.split(c.chunk, dim=1), _targets(target, c.parts, x.shape[1], c.chunk)):
            part = run(xs, ts)
            total = part if total is None else total + part
        return total / (target != IGNORE).sum()

    def _piece(self, x: torch.Tensor, target: torch.Tensor, count: bool = True) -> torch.Tensor:
        """The loss of one chunk: the mean over its tokens, times their number where `count`."""
        c = self.chunked
        amp = torch.autocast(x.device.type, dtype=c.autocast) if c.autocast else contextlib.nullcontext()
        with amp:
            logits = self.inner(x)
        with torch.autocast(x.device.type, enabled=False):  # the loss in fp32, as the pipeline's
            logits = logits.float() if logits.is_floating_point() and logits.element_size() < 4 else logits
            loss = c.loss_fn(logits, target)
        if not count:
            return loss
        # A chunk whose targets are all IGNORE has a mean of 0/0: it counts nothing, and its
        # gradient is zero (the cross-entropy writes none for ignored targets).
        return torch.nan_to_num(loss * (target != IGNORE).sum(), nan=0.0)


def _targets(target: torch.Tensor, parts: int, length: int, chunk: int) -> list[torch.Tensor]:
    """The targets of each chunk of `length` positions: under sequence parallel (`parts` > 1) the
    head gathers chunk j from every process's part, in process order, so its targets are each
    part's j-th slice, side by side."""
    if parts == 1:
        return list(target.split(chunk, dim=1))
    by_part = target.unflatten(1, (parts, length))  # (B, parts, T / parts)
    return [s.flatten(1) for s in by_part.split(chunk, dim=2)]


class _Deferring:
    """Mixed into the head's class (`install`, as FSDP2's `fully_shard` mixes its own in): a call
    with the head's input alone (the stage's) passes it on, no hook run, where the loss will run
    the head (`Chunked.defers`, noted in `waiting`); any other call (the loss's, with the target;
    or where chunks do not help) is the module's own, its hooks and all. The head keeps its place
    and its parameters' names in the stage."""

    def __call__(self, x, *args, **kwargs):
        c = self._chunked
        if not args and not kwargs:  # the stage's call
            c.waiting = c.defers(x)
            if c.waiting:
                return x
            c.last = 0
        return super().__call__(x, *args, **kwargs)


def wanted(head: nn.Module, mode: str) -> bool:
    """Whether a run in `mode` chunks `head`'s loss: not "off", and the head declares itself
    position-wise (`per_position`, as `tp_plan` and `recompute` are declared on a block)."""
    return mode != "off" and bool(getattr(head, "per_position", False))


def install(stage: nn.Module, head: nn.Module, chunk: int, mode: str = "auto",
            autocast: torch.dtype | None = None, parts: int = 1, vocab_parts: int = 1) -> Chunked | None:
    """Chunk the loss of `head`, the last block of the wrapped last `stage`, in place: the head's
    forward replaced (`Chunked`), its class given `_Deferring`'s call. After every wrapper: the
    head keeps its own (FSDP2's unit, tensor parallel's hooks) and its place in the stage.
    Returns None where the head is not position-wise (`per_position`) or `mode` is "off" (`wanted`).

    Under FSDP2 a head that is no unit of its own (tied to the embedding in one stage: the
    stage's root holds the shared weight) keeps the root's weights gathered from the stage's
    forward to its backward: the loss, after that forward, runs the head on them.

    Raises:
        BrigadeError: `chunk` < 1.
    """
    from torch.distributed.fsdp import FSDPModule

    if not wanted(head, mode):
        return None
    head._chunked = Chunked(head, chunk, mode, autocast, parts, vocab_parts)
    if not isinstance(head, _Deferring):  # a head assembled again (the bench's next case) has it
        cls = type(head)  # its name kept: messages name the block as the model does
        head.__class__ = type(cls.__name__, (_Deferring, cls), {"__module__": cls.__module__})
    if isinstance(stage, FSDPModule) and not isinstance(head, FSDPModule):
        stage.set_reshard_after_forward(False, recurse=False)
    return head._chunked


def vocab(head: nn.Module) -> int:
    """The head's output size: its last linear layer's (a tp "vocab" split counts whole)."""
    linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise BrigadeError(f"{type(head).__name__} declares per_position but has no output layer "
                           "(nn.Linear): chunking its loss needs one")
    weight = linears[-1].weight
    return weight.shape[0]  # a DTensor's shape is its whole
