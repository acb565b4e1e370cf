"""Sequence parallel: under tensor parallel, what a block keeps whole on every tp process (its
norms, its residual stream, the dropout after its projections) is split along the sequence
instead, each tp process holding T / tp positions (Megatron-LM's sequence parallelism, torch's
`SequenceParallel`).

A block takes part when its plan (`parallel.tensor`) names a submodule "sequence" (a norm). Such a
block takes and gives this process's part of the sequence, (B, T/tp, C), and inside it:

    part ─► norm ("sequence": on the part, its weight replicated) ─► gather ─► colwise ─► …
         ─► rowwise ─► reduce-scatter: a part ─► + residual (a part) ─► part

The gather (an all-gather along the sequence) is where a "gather" entry names it (the module
whose input the colwise layers share: an attention, an MLP), else at each colwise layer's input.
The rowwise output's all-reduce of plain tensor parallel becomes a reduce-scatter, so the two
collectives move what plain tensor parallel's one did, and everything between blocks (and what
the pipeline sends) is 1/tp of it.

Between a whole block (an embedding, a head: an empty plan) and a sequence-parallel one the
assembler puts a boundary (`boundaries`): whole → part keeps this process's slice (its backward
gathers the gradient, so the whole block's weights get the same gradient on every tp process);
part → whole all-gathers (its backward keeps this process's slice of a gradient that is the
same on every tp process). The last block's output, which the loss reads, always has every
position: whole, or split along the vocabulary by a "vocab" head (`parallel.vocab`), whose matmul
gathers the positions as a colwise layer does.

The norms' weights see only this process's positions, so their gradients come back `Partial`
(a sum still to be taken over tp): `reduce_partial_grads`, after the step's last backward, takes
it (one all-reduce per such weight; FSDP2 already does it in its reduce-scatter), so the
gradient norm, clipping and the optimizer see one gradient, the same on every tp process.

What a gathered module's matmuls save for their backward is the whole sequence: tp times the
part it came from. In a block that keeps its activations (recompute none) `save_parts` makes them
save this process's part instead and gather it again when the backward needs it (Megatron-LM's
way: one more all-gather in the backward, 1/tp of those bytes held). A recomputed block does not
hold them anyway: its own saved-tensor hooks keep its input only, and are left alone.

    forward:  part ─► gather ─► whole ─► colwise matmul saves whole ─► pack: keep the part
    backward: unpack ─► all-gather the part again ─► the whole the matmul saved

The sequence length must divide by tp. The tp processes share one random stream (`World.stream`),
as whatever they hold whole must get the same dropout masks on each; but inside a block that takes
part every tensor is a part of the sequence or a share of the heads, and the same stream would
give each part the same mask pattern. So such a block draws its masks from a stream of its own on
each tp process (`own_masks`): one seed drawn from the shared stream (which so advances alike on
every tp process), plus the tp rank. Recompute replays it: the seed is drawn again from the same
restored state.
"""

from __future__ import annotations

import torch
from torch import nn

from brigade.errors import BrigadeError
from brigade.parallel import held as meter


def takes_part(block: nn.Module, plan: dict | None) -> bool:
    """Whether `block`'s plan makes it sequence-parallel (a "sequence" entry)."""
    return any(entry == "sequence" for entry in (plan or {}).values())


def check_length(blocks: list[nn.Module], tp: int, length: int, enabled: bool = True) -> None:
    """Before a run: a sequence length that tp divides, where some block would split it.

    Raises:
        BrigadeError: --block-size not a multiple of --tp under sequence parallel.
    """
    if tp > 1 and enabled and length % tp and any(takes_part(b, getattr(b, "tp_plan", None)) for b in blocks):
        raise BrigadeError(f"--block-size {length} does not split into --tp {tp} equal parts, which "
                           f"sequence parallel needs: use a --block-size that {tp} divides, or "
                           "--no-sequence-parallel")


def _length(x: torch.Tensor, tp: int, where: str) -> None:
    if x.dim() < 2 or x.shape[1] % tp:
        raise BrigadeError(f"{where}: sequence parallel splits dimension 1 of a {tuple(x.shape)} "
                           f"tensor over --tp {tp}, which does not divide it: use a sequence length "
                           "(--block-size) that --tp divides, or --no-sequence-parallel")


def to_part(x: torch.Tensor, mesh, where: str = "a block") -> torch.Tensor:
    """This process's part of the sequence of `x` (whole, the same on every tp process): a slice,
    whose gradient is gathered from every part in the backward."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    _length(x, mesh.size(), where)
    whole = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return whole.redistribute(mesh, [Shard(1)]).to_local()


def to_whole(x: torch.Tensor, mesh) -> torch.Tensor:
    """The whole sequence from each process's part `x` (an all-gather along dimension 1); the
    backward keeps this process's slice of the gradient."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    part = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
    return part.redistribute(mesh, [Replicate()]).to_local()


def _convert(convert, where: str):
    """A forward pre-hook that converts a block's first positional input with `convert`."""
    def hook(module: nn.Module, args: tuple):
        if not args or not isinstance(args[0], torch.Tensor):
            raise BrigadeError(f"{where} is at a sequence-parallel boundary but its first input is not "
                               "a tensor: pass the hidden states (B, T, C) first, or --no-sequence-parallel")
        return (convert(args[0]), *args[1:])
    return hook


def boundaries(blocks: list[nn.Module], parts: list[bool], held: list[int], mesh) -> None:
    """Hooks on the held blocks where the whole model changes between whole and parts.

    Args:
        blocks: the whole model's blocks; parts: which of them are sequence-parallel
            (`takes_part`); held: the indices this process holds; mesh: the 1-D tp mesh.
    """
    for i in held:
        gets = i > 0 and parts[i - 1]  # the model's input (block 0's) is whole
        where = f"block {i} ({type(blocks[i]).__name__})"
        if parts[i] and not gets:
            blocks[i].register_forward_pre_hook(_convert(lambda x, w=where: to_part(x, mesh, w), where))
        elif gets and not parts[i]:
            blocks[i].register_forward_pre_hook(_convert(lambda x: to_whole(x, mesh), where))
        if parts[i] and i == len(blocks) - 1:  # the loss reads whole positions
            blocks[i].register_forward_hook(lambda module, args, out: _whole_positions(out, mesh))


def _whole_positions(out, mesh):
    """The last block's output with every position: gathered from parts, unless a "vocab" head
    already gathered them and split its logits along the vocabulary instead (a DTensor), or it is
    a loss (a chunked head's, `parallel.chunked`: the head computed it from its parts)."""
    from torch.distributed.tensor import DTensor

    return out if isinstance(out, DTensor) or out.dim() == 0 else to_whole(out, mesh)


def reduce_partial_grads(modules) -> None:
    """Every gradient left `Partial` (a sequence-parallel norm's, summed over only this process's
    positions) made the sum over its mesh, in the placements of its parameter."""
    from torch.distributed.tensor import DTensor, Partial

    for module in modules:
        for p in module.parameters():
            g = p.grad
            if isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
                p.grad = g.redistribute(g.device_mesh, p.placements)


def gathering(mesh):
    """A forward pre-hook (`with_kwargs`) that hands a module the whole sequence of its input
    (its first positional argument, or `hidden_states=`) as a DTensor replicated over tp: its
    colwise layers take it as it is, and their input gradients, summed in it, go back as one
    reduce-scatter into parts."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def whole(x):
        part = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        return part.redistribute(mesh, [Replicate()])

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        if args and isinstance(args[0], torch.Tensor):
            return (whole(args[0]), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": whole(kwargs["hidden_states"])}
        raise BrigadeError(f"a 'gather' entry's {type(module).__name__} got no tensor to gather: its "
                           "input must come first or as hidden_states=; or --no-sequence-parallel")
    return hook


def whole_sequence(module: nn.Module, mesh) -> None:
    """Hooks on a "whole" module (`parallel.tensor`): handed this process's part, it runs on the
    whole sequence (`to_whole`) and gives back this process's part of its output (`to_part`)."""
    module.register_forward_pre_hook(_convert(lambda x: to_whole(x, mesh), type(module).__name__))
    module.register_forward_hook(lambda m, args, out: to_part(out, mesh, type(m).__name__))


def own_masks(block: nn.Module, mesh) -> None:
    """Hooks on a block that takes part: its forward draws from a stream of this tp process's own
    (the module docstring), and the shared stream is where it was plus one draw after it."""
    rank = mesh.get_local_rank()
    forks: list = []

    def enter(module: nn.Module, args: tuple) -> None:
        seed = int(torch.randint(0, 2**62, (1,)).item())  # the shared stream: alike on every tp process
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        fork = torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else [])
        fork.__enter__()
        forks.append(fork)
        torch.manual_seed(seed + rank)

    def leave(module: nn.Module, args: tuple, out):
        forks.pop().__exit__(None, None, None)

    block.register_forward_pre_hook(enter)
    block.register_forward_hook(leave, always_call=True)


class _Part:
    """What a gathered tensor saved for backward keeps: this process's part, the view the saved
    tensor was of the whole, and the meter's holders of the part (counted as held while it lives)."""

    __slots__ = ("part", "view", "placements", "holders")

    def __init__(self, part: torch.Tensor, saved, placements):
        self.part, self.placements = part, placements
        local = saved._local_tensor if placements is not None else saved
        self.view = (local.shape, local.stride(), local.storage_offset())
        counting = meter.current()
        self.holders = counting.keep([part]) if counting else []


def save_parts(module: nn.Module, mesh) -> None:
    """Hooks on a gathered module (a "gather" entry) of a block without recompute: what its forward
    saves of the whole sequence it was handed is this process's part, gathered again in the
    backward (the module docstring). Every other tensor it saves goes to the meter counting held
    bytes (`parallel.held`) where one is, as it would without these hooks."""
    from torch.autograd.graph import saved_tensors_hooks
    from torch.distributed.tensor import DTensor, Replicate, Shard

    rank, tp = mesh.get_local_rank(), mesh.size()
    open_: list = []

    def whole_of(args: tuple, kwargs: dict):
        x = args[0] if args else kwargs.get("hidden_states")
        return x if isinstance(x, DTensor) else None

    def pack(t: torch.Tensor):
        whole = open_[-1][1]._local_tensor
        if meter.storage_key(t) == meter.storage_key(whole):  # the whole, or a view of it
            n = whole.shape[1] // tp
            return _Part(whole[:, rank * n:(rank + 1) * n].detach().clone(), t,
                         t.placements if isinstance(t, DTensor) else None)
        counting = meter.current()
        return counting._pack(t) if counting else t

    def unpack(h):
        if not isinstance(h, _Part):
            return meter.Held._unpack(h)
        part = DTensor.from_local(h.part, mesh, [Shard(1)], run_check=False)
        size, stride, offset = h.view
        local = part.redistribute(mesh, [Replicate()]).to_local().as_strided(size, stride, offset)
        if h.placements is None:
            return local
        return DTensor.from_local(local, mesh, h.placements, run_check=False)

    def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
        whole = whole_of(args, kwargs)
        hooks = saved_tensors_hooks(pack, unpack) if whole is not None and torch.is_grad_enabled() else None
        if hooks is not None:
            hooks.__enter__()
        open_.append((hooks, whole))

    def leave(module: nn.Module, args: tuple, kwargs: dict, out):
        hooks, _ = open_.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave, with_kwargs=True, always_call=True)
