"""Per-block costs of a model, measured on this machine and scaled to a target device.

Measured here, one process of one thread, for each recompute mode asked:

    times        (forward, backward, weight, input) seconds of every block at a few micro-batch
                 sizes (`measure.stages.block_costs`, interpolated by `interpolate`)
    held         bytes each block holds for backward once its forward is done, per sample
                 (`parallel.held.Held`: under recompute, its input)
    working      what its backward holds on top of that at its most (a recompute's tensors)
    transient    the allocator's peak over its forward and backward beyond its parameters, its
                 gradients and `held` + `working`: temporaries (train.memory.StepMemory)
    accumulating the same for a backward that adds into gradients an earlier one made (a
                 pipeline's later micro-batches), less the block's largest gradient, which it
                 holds beside them until it is added, counted apart
                 (`block_memory.largest_grad`): on the GPT's block (4 × 256) at 4 samples
                 2.3 MiB against none for the first
    kept         what a split backward keeps from a micro-batch's input pass (I) to its weight
                 pass (W) beyond `held`: the gradient at each weight's output (the grad_output
                 a Linear's, a LayerNorm's, a Conv's weight gradient needs; `pipeline.runtime.
                 backward` keeps it on the frontier nodes), and under recompute the tensors the
                 input pass made again (kept until W frees the graph). Measured by running the
                 runtime's own `backward_split` on the block, its input taking a gradient, as
                 the allocator's net bytes over the input pass (its input gradient, sent on,
                 and any weight gradient it made, counted as grads, aside)

and, asked for (`measure(tp=True)`), each mode's blocks again as one of two tensor-parallel
processes runs them (`planner.split_costs`), and (`measure(shard=True)`) what FSDP2's own work
adds to each block where it is sharded (`planner.shard_costs`), and, whatever the mode: each
block's parameter bytes (by parameter, so a weight tied across blocks of one stage counts once
there), FLOPs per sample of its forward and backward (torch.utils.flop_counter), its output's
bytes per sample (what a pipeline sends), and seconds per byte of parameters for the optimizer
step (AdamW, clipping, zeroing).

Scaled to a target device by `planner.scaling.scaled`. Planned for this machine in bf16 or fp16,
the times are measured on a copy of the blocks in that dtype (`measure(precision=)`): a CPU's
half-precision kernels are no fixed fraction of its fp32 ones (here a bf16 matmul took 60 times
an fp32 one, a GPT block's step 6 to 9 times). Memory is always measured in fp32 and halved by
the memory model where the run computes in half precision.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import partial

import torch

from brigade.host import malloc
from brigade.measure.stages import block_costs
from brigade.models import ModelSpec
from brigade.models.flops import flop_counter
from brigade.parallel import compiled, recompute
from brigade.parallel.vocab import split_loss
from brigade.pipeline.batches import microbatch
from brigade.pipeline.batches.sample import runnable, take, tokens_per_sample
from brigade.planner.attention import AttentionFacts
from brigade.planner.block_memory import block_memory
from brigade.planner.devices import DeviceSpec
from brigade.planner.mixture import Mixture, mixture
from brigade.planner.optimizer import optimizer_transient, seconds_per_byte
from brigade.planner.shard_costs import measure_shard
from brigade.planner.split_costs import TP, SplitCosts, measure_split
from brigade.planner.tensor import TensorFacts
from brigade.world.mesh import fake_world

MEASURED, SCALED, FORMULA = "measured", "scaled", "formula"
REPEATS = 9  # timings per block and size, their median kept: on 2 shared cores 3 swung by a fifth


@dataclass
class ModeCosts:
    """One recompute mode's measurements (module docstring); memory in bytes per sample."""

    times: dict[int, list[tuple[float, ...]]]
    held: list[float]
    working: list[float]
    transient: list[float]
    kept: list[float]
    # per block, what a backward that adds into gradients already made allocates beyond them, its
    # held bytes and its largest gradient (`largest_grad`, counted apart: not per sample); empty:
    # not measured (from shapes), `transient` stands for it
    accumulating: list[float] = field(default_factory=list)
    split: SplitCosts | None = None  # the blocks on one tp process (`planner.split_costs`)


@dataclass
class ModelCosts:
    """Everything the planner knows of a model, per block (module docstring)."""

    name: str
    params: list[dict[int, int]]  # per block: parameter id -> bytes
    flops: list[float]  # per sample, forward + backward
    out_bytes: list[float]  # per sample
    modes: dict[str, ModeCosts]
    optimizer_s_per_byte: float
    here: DeviceSpec | None  # None: memory only (`measure_memory`)
    source: str = MEASURED
    scale: float = 1.0  # target seconds per second here (compute)
    mem_scale: float = 1.0  # the same for the optimizer's memory-bound step
    notes: list[str] = field(default_factory=list)
    tensor: TensorFacts | None = None  # what tensor parallel does to the blocks (`planner.tensor`)
    # per block, the bytes AdamW's step allocates beyond its state when it steps that block alone;
    # `opt_foreach`: a step over several blocks allocates their sum (a foreach update), not the
    # largest (one tensor at a time)
    opt_transient: list[float] = field(default_factory=list)
    opt_foreach: bool = False
    precision: str = ""  # the dtype the times were measured in ("": fp32)
    # the dtype the memory columns were counted in: "" fp32 (measured here; the memory model halves
    # them where the run computes in half precision), "bf16" or "fp16" as such a run holds them,
    # what the model upcasts (norms, the loss's logits) at fp32's size (from shapes, `formula`)
    memory_dtype: str = ""
    # per block, the seconds FSDP2's own work adds to one gather-forward-gather-backward-reduce
    # cycle of it (`shard_costs`); empty: not measured
    shard_s: list[float] = field(default_factory=list)
    mixture: Mixture | None = None  # a mixture of experts' facts (`planner.mixture`); None: dense
    # each block's attention calls, what context parallel exchanges (`planner.attention`); None: not
    # observed, or no attention (cp exchanges nothing)
    attention: AttentionFacts | None = None
    # the same costs with the head's loss whole, where these chunk it (`formula._chunked`): what a
    # layout whose plan splits the backward holds, since training chunks no loss there (`predict`)
    unchunked: ModelCosts | None = None

    @property
    def n_blocks(self) -> int:
        return len(self.flops)

    def block_times(self, mode: str, size: int) -> list[tuple[float, ...]]:
        """(forward, backward, weight, input) target seconds of each block at micro-batch `size`."""
        return [tuple(c * self.scale for c in b) for b in interpolate(self.modes[mode].times, size)]

    def param_bytes(self, blocks: range, tp: int = 1, ep: int = 1) -> float:
        """Bytes of the parameters of these blocks, a shared one once; on one of `tp` processes,
        each block's split share divided by `tp`; on one of an expert group of `ep`, its experts'
        weights divided by `ep` (unsharded: what a process of the group holds whole)."""
        seen: dict[int, float] = {}
        for b in blocks:
            f = self.tp_factor(b, tp)
            seen.update({pid: n * f / self.ep_share(b, pid, ep) for pid, n in self.params[b].items()})
        return sum(seen.values())

    def expert_bytes(self, blocks, ep: int = 1) -> float:
        """Bytes of these blocks' experts' weights on one process of an expert group of `ep`."""
        if self.mixture is None:
            return 0.0
        return sum(n / ep for b in blocks for pid, n in self.params[b].items() if pid in self.mixture.ids[b])

    def ep_share(self, block: int, pid: int, ep: int) -> int:
        """What a parameter is divided by on one process of an expert group of `ep`: ep for one of
        the block's experts' weights, else 1."""
        return ep if ep > 1 and self.mixture is not None and pid in self.mixture.ids[block] else 1

    def largest(self, block: int, tp: int = 1, ep: int = 1) -> float:
        """Bytes of the block's largest parameter on one process (`param_bytes`' shares)."""
        return max((n / self.ep_share(block, pid, ep) for pid, n in self.params[block].items()),
                   default=0) * self.tp_factor(block, tp)

    def opt_transient_bytes(self, blocks: list[int]) -> float:
        """What AdamW's step over these blocks' parameters allocates beyond its state (0: not
        measured)."""
        got = [self.opt_transient[b] for b in blocks if b < len(self.opt_transient)]
        return (sum(got) if self.opt_foreach else max(got)) if got else 0.0

    def part(self, block: int, tp: int) -> float:
        """The share of a block's output one of `tp` processes holds: 1/tp under sequence
        parallel (what the pipeline sends, a first stage keeps), else the whole."""
        return 1 / tp if tp > 1 and self.tensor is not None and self.tensor.sequence(block, tp) else 1.0

    def splits(self, block: int, tp: int) -> bool:
        """Whether one of `tp` processes holds a share of the block's activations, not the whole:
        the block is sequence-parallel, or a head that splits its vocabulary."""
        t = self.tensor
        return tp > 1 and t is not None and (t.sequence(block, tp) or t.splits_vocab(block, tp))

    def working(self, mode: str, block: int, tp: int = 1) -> float:
        """Bytes per sample the block's backward holds beyond `held` at its most (a recompute's
        tensors), on one of `tp` processes: as measured there where the costs were measured on
        one at this degree (`split_costs`); else the tp 1 figure, scaled where the block splits
        its activations as what it would hold without recompute scales (that is what a recompute
        makes again; 1/tp where no figure without recompute was measured)."""
        m = self.modes[mode]
        if m.split is not None and m.split.tp == tp > 1:
            return m.split.working[block]
        if not self.splits(block, tp):
            return m.working[block]
        none = self.modes.get("none")
        share = self.held("none", block, tp) / none.held[block] if none and none.held[block] else 1 / tp
        return m.working[block] * share

    def held(self, mode: str, block: int, tp: int = 1) -> float:
        """Bytes per sample `block` holds for its backward under recompute `mode`, on one of `tp`
        processes. Whole but under sequence parallel: there the block's input is a part (all
        full recompute holds) and so is the rest, but for the whole copies of the sequence its
        matmuls hold (`TensorFacts.gathered`) in place of its norms' outputs (`normed`); without
        recompute those a "gather" entry makes are kept as parts (`shared`). A head that splits
        its vocabulary holds its logits' share (1/tp) beside the whole copy of its input."""
        h = self.modes[mode].held[block]
        if self.part(block, tp) == 1.0:
            return h
        if mode == "full":
            return h / tp
        t = self.tensor  # the width of what is split along the sequence: the block's input
        out = self.out_bytes[block - 1] if block and t.splits_vocab(block, tp) else self.out_bytes[block]
        parts = t.shared[block] if mode == "none" and t.shared else 0
        copies = (t.gathered[block] - parts) * out + parts * out / tp
        return max(h / tp, (h - t.normed[block] * out) / tp + copies)

    def tp_factor(self, block: int, tp: int) -> float:
        """A block's split work and parameters at degree `tp`, as a share of its whole (1 at tp 1)."""
        return self.tensor.factor(block, tp) if self.tensor is not None and tp > 1 else 1.0


def master_bytes(blocks) -> list[dict[int, int]]:
    """Per block, parameter id -> the bytes of its fp32 master copy, 4 a parameter: what every
    layout keeps, whatever dtype the model was built in (`planner.memory`)."""
    return [{id(p): p.numel() * 4 for p in b.parameters()} for b in blocks]


def interpolate(samples: dict[int, list], size: int) -> list[tuple[float, ...]]:
    """Per-block costs at micro-batch `size`, linear between the measured sizes (outside them,
    in proportion to the nearest one)."""
    sizes = sorted(samples)
    lo = max([s for s in sizes if s <= size], default=sizes[0])
    hi = min([s for s in sizes if s >= size], default=sizes[-1])
    if lo == hi:
        return [tuple(c * size / lo for c in block) for block in samples[lo]]
    t = (size - lo) / (hi - lo)
    return [tuple(a + t * (b - a) for a, b in zip(ca, cb)) for ca, cb in zip(samples[lo], samples[hi])]


def measure(spec: ModelSpec, sizes: list[int], modes: list[str], here: DeviceSpec,
            precision: str = "", tp: bool = False, shard: bool = False, compile: bool = False) -> ModelCosts:
    """Measure `spec`'s blocks here at micro-batch `sizes` under each recompute mode (one thread),
    timed in `precision` ("bf16", "fp16": on a copy in that dtype; module docstring); with `tp`,
    each mode also on one of `split_costs.TP` tensor-parallel processes (fp32), and with `shard`
    what FSDP2's own work adds to each block (`shard_costs`), where this process can fake their
    world; with `compile`, the timed blocks compiled as --compile compiles them (`parallel.compiled`).

    With freed memory kept, as every training process keeps it (`brigade.host.malloc`, set for the
    rest of this process): with malloc's defaults each fresh gradient page-faults in again, and
    AdamW's step on the MLP's parameters measured 1.9-3.2 ms a MiB against 1.2-1.4 with it kept,
    which the training steps run at (about 20 ms a step too much on the MLP's pipeline of two)."""
    malloc.keep_freed_memory()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x, y = spec.make_batch(max(sizes), torch.Generator().manual_seed(0))
        per_mode = {m: _mode(spec, x, y, sizes, m, HALF.get(precision), compile) for m in modes}
        if tp and precision not in HALF:
            _split(spec, x, y, sizes, per_mode)
        shard_s = _shard(spec, take(x, min(sizes)), take(y, min(sizes)), HALF.get(precision)) if shard else []
        flops, outs = _flops_and_outputs(spec, take(x, min(sizes)), take(y, min(sizes)))
        params = master_bytes(spec.blocks)
        opt = seconds_per_byte(spec)
        stepping, foreach = optimizer_transient(spec.blocks)
    finally:
        torch.set_num_threads(threads)
    return ModelCosts(spec.name, params, flops, outs, per_mode, opt, here, opt_transient=stepping,
                      opt_foreach=foreach, precision=precision if precision in HALF else "", shard_s=shard_s,
                      mixture=mixture(spec.blocks, tokens_per_sample(spec)))


def measure_memory(spec: ModelSpec, size: int, modes: list[str]) -> ModelCosts:
    """Only what the memory model reads (`planner.memory.rank_memory`): parameter bytes, output
    bytes and, per recompute mode, the held, working, transient and kept bytes per sample at
    micro-batch `size`; no times, FLOPs or device (the tuner's memory limit, which times on its
    own)."""
    x, y = spec.make_batch(size, torch.Generator().manual_seed(0))
    per_mode = {}
    for mode in modes:
        blocks = copy.deepcopy(spec.blocks)
        recompute.apply(blocks, mode)
        per_mode[mode] = ModeCosts({}, *block_memory(spec.loss_fn, blocks, x, y, size))
    params = master_bytes(spec.blocks)
    stepping, foreach = optimizer_transient(spec.blocks)
    return ModelCosts(spec.name, params, [0.0] * len(spec.blocks), _out_bytes(spec, x, size), per_mode, 0.0,
                      here=None, opt_transient=stepping, opt_foreach=foreach,
                      mixture=mixture(spec.blocks, tokens_per_sample(spec)))


HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _mode(spec: ModelSpec, x, y, sizes: list[int], mode: str, dtype: torch.dtype | None = None,
          compile: bool = False) -> ModeCosts:
    """One recompute mode's times (in `dtype`, on a copy: None, fp32; with `compile`, of compiled
    blocks) and memory (in fp32, eager)."""
    blocks = copy.deepcopy(spec.blocks)
    chosen = recompute.apply(blocks, mode)
    timed = blocks if dtype is None and not compile else [copy.deepcopy(b) for b in blocks]
    timed = timed if dtype is None else [b.to(dtype) for b in timed]
    if compile:
        compiled.compile_blocks(timed, list(range(len(timed))), chosen)
    times = {}
    for s in sizes:
        h, bound = runnable(timed, take(x, s))
        if dtype is not None and h.is_floating_point():
            h = h.to(dtype)
        times[s] = block_costs(bound, h, spec.loss_fn, take(y, s), repeats=REPEATS)
    s = min(sizes)
    return ModeCosts(times, *block_memory(spec.loss_fn, blocks, x, y, s))


def _split(spec: ModelSpec, x, y, sizes: list[int], per_mode: dict[str, ModeCosts]) -> None:
    """Each mode's `SplitCosts`, in place, where a fake world of `TP` processes can be made here."""
    with fake_world(TP) as mesh:
        if mesh is None:
            return
        loss_fn = split_loss(spec.loss_fn)  # logits a "vocab" head leaves split, as training takes them
        for mode, costs in per_mode.items():
            costs.split = measure_split(spec.blocks, x, y, loss_fn, sizes, mode, mesh,
                                        partial(block_memory, loss_fn), REPEATS)


def _shard(spec: ModelSpec, x, y, dtype: torch.dtype | None) -> list[float]:
    """Each block's `shard_costs.measure_shard` on the batch x, y, where a fake world of two
    processes can be made here (else none: [])."""
    with fake_world(2) as mesh:
        return [] if mesh is None else measure_shard(spec.blocks, x, y, spec.loss_fn, dtype, mesh, REPEATS)


def _out_bytes(spec: ModelSpec, x, n: int) -> list[float]:
    """Each block's output bytes per sample (what a pipeline sends; a first stage's kept), on the
    batch x of `n` samples."""
    h, blocks = runnable(spec.blocks, x)
    outs = []
    with torch.no_grad():
        for block in blocks:
            h = block(h)
            outs.append(h.numel() * h.element_size() / n if torch.is_tensor(h) else 0.0)
    return outs


def _flops_and_outputs(spec: ModelSpec, x, y) -> tuple[list[float], list[float]]:
    """FLOPs (forward + backward) and output bytes, per sample, of each block."""
    flops, outs = [], []
    h, blocks = runnable(spec.blocks, x)
    n = microbatch.batch_size_of(h)
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        inp = h.detach().requires_grad_(h.is_floating_point() and i > 0)
        with flop_counter() as counter:  # an MoE's grouped matmuls counted too (`models.flops`)
            out = block(inp)
            loss = spec.loss_fn(out, y) if last else out
            torch.autograd.backward(loss, None if last else torch.ones_like(loss))
        block.zero_grad(set_to_none=True)
        flops.append(counter.get_total_flops() / n)
        outs.append(out.numel() * out.element_size() / n if torch.is_tensor(out) else 0.0)
        h = out.detach()
    return flops, outs
