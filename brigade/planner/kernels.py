"""A block's seconds from its kernels, counted on the meta device: what `planner.formula` times
a model with, in place of one share of peak for everything.

Every aten op a block's forward and backward run (on the meta device: shapes, no storage) falls
in one of four kinds, each at its own rate (`Rates`, from the target's `DeviceSpec`):

    matmul        mm, addmm, bmm, baddbmm, grouped mm: FLOPs (torch's flop counter's formulas)
                  at the matmul peak × `matmul_eff`; under float8 the blocks' linear layers (a
                  matmul with a weight among its operands, not the head's) at the float8 peak
    attention     a fused scaled-dot-product attention (`formula.FusedAttention`): 4·B·H·Sq·Sk·D
                  FLOPs forward (half of it causal: the kernel skips the masked tiles), 2.5 × that
                  backward (five matmuls to two), at `attention_eff` and `attention_bwd_eff` of
                  the half-precision peak
    memory-bound  everything else that makes a tensor (norms, rotary embedding, activations,
                  residual adds, softmax and the loss, casts): the bytes it reads and writes ÷
                  (memory bandwidth × `mem_eff`); views and factory ops move nothing
    float8 casts  under float8, each float8 matmul's scaling: an amax pass and a cast of its
                  activation input forward (read twice, write one byte an element) and of its
                  output's gradient backward, and the fp8 transposed copies its backward matmuls
                  read (input and gradient: read and write one byte an element each)

Eager, every memory-bound op is its own kernel: it reads its inputs and writes its outputs. Under
`--compile` (Inductor) the memory-bound ops between two matmul or attention calls are fused into
one kernel (`Fusion`): it reads each tensor made outside it once and writes only what something
outside it reads (a matmul, attention, a later region, the backward's saved tensors, the block's
output); float8's amax pass fuses into the op that makes its input (the cast still reads again).
That is what `torch.compile` removes, counted; no measured speed-up is applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from brigade.planner.devices import DeviceSpec

aten = torch.ops.aten
MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
if hasattr(aten, "_grouped_mm"):
    MATMULS.add(aten._grouped_mm)
FREE = {aten.empty, aten.empty_like, aten.empty_strided, aten.detach, aten.lift_fresh, aten.alias}
ATTENTION_BWD_FLOPS = 2.5  # a fused attention's backward over its forward: five S×S matmuls to two


@dataclass(frozen=True)
class Rates:
    """FLOP/s and bytes/s of each kind of kernel on one device (module docstring)."""

    matmul: float
    fp8: float  # float8 matmuls; 0: no float8 peak known
    attention: float
    attention_bwd: float
    memory: float  # the meta blocks run in the run's precision (`formula.in_dtype`): bytes as moved

    @classmethod
    def of(cls, d: DeviceSpec, precision: str) -> Rates:
        """A device's rates for `precision`: its peaks × what each kind reaches (`DeviceSpec`)."""
        peak = d.peak(precision)
        return cls(peak * d.matmul_eff, d.peak_fp8 * d.matmul_eff, peak * d.attention_eff,
                   peak * d.attention_bwd_eff, d.mem_bw * d.mem_eff)


@dataclass
class Tally:
    """One phase's work (a forward or a backward), by kind."""

    matmul: float = 0.0  # FLOPs
    fp8: float = 0.0  # FLOPs of float8 matmuls
    attention: float = 0.0  # effective FLOPs (causal halved)
    eager_bytes: float = 0.0
    fused_bytes: float = 0.0
    cast_eager: float = 0.0  # float8 scaling's bytes (as a run moves them), eager
    cast_fused: float = 0.0  # and compiled

    def seconds(self, r: Rates, attention_rate: float, compiled: bool) -> float:
        """This phase's seconds at rates `r` (`attention_rate`: the forward's or the backward's)."""
        moved = self.fused_bytes if compiled else self.eager_bytes
        cast = self.cast_fused if compiled else self.cast_eager  # counted in the bytes a run moves
        return self.matmul_seconds(r) + self.attention / attention_rate + (moved + cast) / r.memory

    def matmul_seconds(self, r: Rates) -> float:
        return self.matmul / r.matmul + (self.fp8 / r.fp8 if r.fp8 > 0 else self.fp8 / r.matmul)


def _nbytes(t: torch.Tensor) -> float:
    return float(t.numel() * t.element_size())


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


@dataclass
class Fusion:
    """Inductor's fusion, as counted (module docstring): tensors made by memory-bound ops, not yet
    written (`pending`, by id, with their bytes), and those read by the current region."""

    pending: dict[int, tuple[torch.Tensor, float, int]] = field(default_factory=dict)
    # by id, each tensor held: a freed one's id may be another's next, which would read as read
    read: dict[int, torch.Tensor] = field(default_factory=dict)
    region: int = 0

    def written(self, t: torch.Tensor) -> float:
        """Bytes of writing `t` out, once, if a fused region made it and kept it in registers."""
        entry = self.pending.pop(id(t), None)
        return entry[1] if entry is not None else 0.0

    def reads(self, t: torch.Tensor) -> float:
        """Bytes a fused op's read of `t` costs: nothing made in this region, or read already."""
        entry = self.pending.get(id(t))
        cost = 0.0
        if entry is not None:
            if entry[2] == self.region:
                return 0.0
            cost += self.written(t)
        if id(t) not in self.read:
            self.read[id(t)] = t
            cost += _nbytes(t)
        return cost

    def boundary(self) -> None:
        self.region += 1
        self.read = {}


class KernelCount(TorchDispatchMode):
    """The work of the ops run inside it, by kind (module docstring), into `tally`; switch phases
    with `phase`. `linears`: the shapes (out, in) of the weights whose matmuls float8 takes
    (empty: no float8): a matmul with an operand of that shape (or its transpose) reads the
    weight (forward, input gradient), one that makes that shape is the weight's gradient;
    `attention`: the `formula.FusedAttention` whose calls are counted apart (`attention_call`)."""

    def __init__(self, attention, linears: set[tuple[int, int]] = frozenset()):
        super().__init__()
        self.attention = attention
        self.linears = set(linears) | {(i, o) for o, i in linears}
        self.fusion, self.tally = Fusion(), Tally()

    def phase(self, tally: Tally) -> None:
        """Count into `tally` from now on; what the last phase made and kept is written now."""
        self.flush()
        self.tally = tally

    def flush(self) -> None:
        self.tally.fused_bytes += sum(b for _, b, _ in self.fusion.pending.values())
        self.fusion = Fusion()

    def saved(self, t: torch.Tensor) -> None:
        """Autograd keeps `t` for the backward: a fused region writes it out."""
        self.tally.fused_bytes += self.fusion.written(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.attention.inside:
            return out
        packet = func.overloadpacket
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        if packet in MATMULS:
            self._matmul(packet, args, kwargs, out, ins)
        elif func.is_view or packet in FREE:
            for o in outs:  # a view of a made tensor is that tensor, written when it is
                src = next((self.fusion.pending[id(i)] for i in ins if id(i) in self.fusion.pending), None)
                if src is not None:
                    self.fusion.pending[id(o)] = (o, 0.0, src[2])
        else:
            self._memory_bound(ins, outs)
        return out

    def _matmul(self, packet, args, kwargs, out, ins) -> None:
        flops = flop_registry[packet](*args, **kwargs, out_val=out) if packet in flop_registry else 0
        for t in ins:  # what a fused region made, a matmul reads from memory
            self.tally.fused_bytes += self.fusion.written(t)
        self.fusion.boundary()
        shapes = [tuple(t.shape) for t in ins if t.dim() == 2]
        weight = [s for s in shapes if s in self.linears]
        if not weight and (not torch.is_tensor(out) or tuple(out.shape) not in self.linears):
            self.tally.matmul += flops
            return
        self.tally.fp8 += flops
        if weight:  # the activation (forward) or the output's gradient (backward): scaled, cast,
            # and copied transposed for the weight-gradient matmul; the weight's transposed copy
            x = sum(t.numel() for t in ins if t.dim() >= 2 and tuple(t.shape) not in self.linears)
            w = weight[0][0] * weight[0][1]
            self.tally.cast_eager += 5 * x + 2 * x + 2 * w
            self.tally.cast_fused += 3 * x + 2 * x + 2 * w

    def _memory_bound(self, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        self.tally.eager_bytes += sum(map(_nbytes, ins)) + sum(map(_nbytes, outs))
        self.tally.fused_bytes += sum(self.fusion.reads(t) for t in ins)
        for o in outs:
            self.fusion.pending[id(o)] = (o, _nbytes(o), self.fusion.region)

    def attention_call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       backward: bool) -> None:
        """A fused attention's FLOPs (module docstring); its inputs read from memory."""
        b_h_sq = q.numel() // q.shape[-1]
        flops = 4 * b_h_sq * k.shape[-2] * q.shape[-1] * (0.5 if causal else 1.0)
        self.tally.attention += flops * (ATTENTION_BWD_FLOPS if backward else 1.0)
        for t in (q, k, v):
            self.tally.fused_bytes += self.fusion.written(t)
        self.fusion.boundary()
