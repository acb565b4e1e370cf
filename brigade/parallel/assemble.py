"""The one stage assembler: a model's blocks, their cut and the parallel world in, this process's
wrapped stages out. `brigade train`, `brigade check`, `brigade bench` and `brigade tune` all build
their stages here, so what the check proves equal to one device is what training runs.

    blocks ─ cut (blocks per stage, stage → pipeline rank) ─ ties across stages untied
           ─ this process's stages kept ─ meta blocks given memory ─ moved to the device
           ─ the wrappers, in ORDER:
               0. float8            each held block's eligible linear layers swapped for torchao's
                                    float8 ones, with --float8 (parallel.float8): first, since it
                                    replaces the very modules the others hook or wrap
               1. tensor parallel   each held block's tp_plan over the world's "tp" mesh (parallel.tensor),
                                    sequence parallel where a plan allows it and the run wants
                                    it, with the boundaries between parts and whole blocks
                                    (parallel.sequence)
              1b. context parallel  each held block's attention over the world's "cp" group, by
                                    all-to-all or ring, and its part's global positions, with
                                    --cp (parallel.context); the pipeline cuts each micro-batch
                                    along the sequence
               2. recompute         each held block's forward, by its mode (parallel.recompute)
              2b. lora             with --lora, adapters on each held block's targeted linear
                                   layers, split as tensor parallel split them, and every other
                                   weight frozen (parallel.lora)
               3. expert parallel   each held MoE layer's experts split over the expert group,
                                    its tokens sent to them by all-to-all, with --ep
                                    (parallel.experts)
               4. compile           each held block's forward on its own, with --compile
                                    (parallel.compiled)
               5. shard / replicate each stage under FSDP2 over the world's shard mesh
                                    (parallel.shard), or DDP over its data-parallel group
                                    (parallel.replicate), where the stage has replicas (or
                                    context-parallel processes: over dp × cp); under
                                    --ep the experts are a unit of their own over the expert
                                    mesh's "edp" (FSDP2), or left out of DDP and summed by hand
           ─ weights read into what each process holds (hf:DIR: a DTensor's own part)

A run's precision (bf16, fp16) is applied here too, the one way each layout allows: where its
stages are sharded (FSDP2), by FSDP2's mixed precision (fp32 shards, bf16 gathered weights and
activations, fp32 reductions: `parallel.shard`) and the pipeline runs without autocast; elsewhere
(DDP, a pipeline or tensor parallel without replicas, local stages) the parameters stay fp32 and
the pipeline runs its forwards under autocast (`precision`, `Assembly.autocast`).

This is torchtitan's order (tensor parallel, activation checkpointing, compile, FSDP): a wrapper
that changes what a block computes comes before one that changes where its parameters live. The
axes still to come take their places in it: context parallel after tensor parallel, compile
and float8 between recompute and sharding. Recompute only replaces a block's `forward` and runs
its submodules again, tensor-parallel collectives included, so it may stand before or after
tensor parallel; sharding must come last (FSDP2 takes the DTensors tensor parallel made and
makes them 2-D).

The pipeline that runs the stages (`Assembly.pipeline`) is built here too: one process per
pipeline rank over the world's "pp" group, or every rank in this process (local stages).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from brigade.models.hf.weights import materialize
from brigade.parallel import chunked, compiled, context, experts, lora, recompute, sequence, tensor, vocab
from brigade.parallel import float8 as fp8
from brigade.parallel.replicate import data_parallel
from brigade.parallel.shard import shard_policy, shard_stage
from brigade.pipeline.pipe import LocalPipeline, Pipeline
from brigade.pipeline.plans.action import W
from brigade.pipeline.plans.schedule import build
from brigade.pipeline.stages.partition import split
from brigade.pipeline.stages.ties import StageTies, aliases, find_shared
from brigade.world.mesh import World

# the wrappers, first applied first
ORDER = ("float8", "tensor parallel", "context parallel", "recompute", "lora", "expert parallel",
         "compile", "shard or replicate")


@dataclass(frozen=True)
class Cut:
    """A model cut into stages, and where each stage runs.

    balance: blocks per stage, stage 0's first; ranks: stage → pipeline rank (the schedule's
    placement, `plans.schedule.placement`); several stages on one rank under V > 1.
    """

    balance: tuple[int, ...]
    ranks: tuple[int, ...]

    @property
    def virtual(self) -> int:
        """Stages per pipeline rank."""
        return len(self.ranks) // len(set(self.ranks))

    def blocks(self, stage: int) -> range:
        """The indices of `stage`'s blocks in the whole model."""
        start = sum(self.balance[:stage])
        return range(start, start + self.balance[stage])


class OwnedBlocks(nn.Module):
    """The blocks this process holds, named by their index in the whole model.

    Args:
        blocks: the whole model's blocks; indices: those held here.
        tied: every use of a shared parameter but its first → the first's name, as
            `ties.aliases` gives them (default: found in `blocks`, which must still be tied).
            A snapshot stores each shared parameter once, under its first name.
    """

    def __init__(self, blocks: list[nn.Module], indices: list[int], tied: dict[str, str] | None = None):
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): blocks[i] for i in indices})
        self.aliases: dict[str, str] = aliases(find_shared(blocks)) if tied is None else dict(tied)


@dataclass
class Assembly:
    """This process's part of the model, wrapped.

    stages: {stage: module} for the stages this process runs (every stage under local stages),
        each wrapped (DDP, FSDP2) where it has replicas; held: {block index: block} of those
        stages, unwrapped (a block's parameters are DTensors under tensor parallel or sharding);
        owned: the same blocks under their global names (what the optimizer and snapshots see);
        ties: the shared weights, summed after each step's last backward (`ties.sum_grads(held)`);
        modes: each block's recompute mode; eager: the held blocks --compile left eager
        (`compiled.compile_blocks`); float8: what --float8 converted.
    """

    world: World
    cut: Cut
    stages: dict[int, nn.Module]
    held: dict[int, nn.Module]
    owned: OwnedBlocks
    ties: StageTies
    modes: list[str]
    autocast: torch.dtype | None = None  # what the pipeline runs its forwards under
    mixed: torch.dtype | None = None  # the sharded stages' gathered-weight dtype (FSDP2's policy)
    eager: list[int] = field(default_factory=list)
    float8: fp8.Conversion | None = None  # what --float8 converted (its `line()`)
    context: context.ContextParallel | None = None  # --cp: the cut of every sequence
    chunked: chunked.Chunked | None = None  # the last stage's head, its loss chunked (held here)

    def after_optimizer_step(self) -> None:
        """What the wrappers need once the weights changed: float8's scales for FSDP's float8
        all-gathers, all at once (`float8.refresh_scales`)."""
        if self.float8 is not None and self.float8.float8_all_gather:
            fp8.refresh_scales(self.owned)

    def settle_grads(self) -> None:
        """After the step's last backward: every copy of a shared weight given the sum of their
        gradients (`ties`), and every gradient tensor parallel left partial summed over tp
        (`sequence.reduce_partial_grads`, `tensor.sum_per_head_grads`). What the gradient norm,
        clipping and the optimizer read is then one gradient per weight, the same wherever it
        is held. Under --cp, after the first step, that attention went through its method
        (`context.ContextParallel.verify`)."""
        self.ties.sum_grads(self.held)
        if self.context is not None:  # once: the model's attention went through --cp's method
            self.context.verify(self.world.device)
        if self.world.degrees.ep > 1:  # the experts' mean over dp (DDP left them out)
            experts.reduce_grads(list(self.held.values()), self.world, sharded(self.world))
        if self.world.degrees.tp > 1:
            sequence.reduce_partial_grads(self.held.values())
            tensor.sum_per_head_grads(self.held.values(), self.world.group("tp"))

    def pipeline(self, schedule: str, n_microbatches: int, loss_fn, costs=None):
        """The pipeline that runs these stages under `schedule`: a `Pipeline` over the world's "pp"
        group, or a `LocalPipeline` over the world's devices (local stages). Under tp the loss
        takes logits a "vocab" head left split (`vocab.split_loss`); where the head's loss is
        chunked (`parallel.chunked`), the loss runs the head, unless `schedule` splits backwards
        into I and W (no memory saved there: `chunked`'s docstring)."""
        if self.world.degrees.tp > 1:
            loss_fn = vocab.split_loss(loss_fn)
        if self.chunked is not None:
            n_ranks = len(set(self.cut.ranks))
            plan = build(schedule, n_ranks, n_microbatches, self.cut.virtual, costs)
            self.chunked.on = not any(a.op == W for acts in plan.values() for a in acts)
            loss_fn = self.chunked.loss(loss_fn)
        if self.world.local:
            stages = [self.stages[s] for s in range(len(self.cut.ranks))]
            return LocalPipeline(stages, self.world.devices, schedule, n_microbatches, loss_fn,
                                 autocast=self.autocast, virtual=self.cut.virtual, costs=costs)
        pipe = Pipeline(self.stages, schedule, n_microbatches, loss_fn, group=self.world.group("pp"),
                        device=self.world.device, autocast=self.autocast, virtual=self.cut.virtual,
                        costs=costs, parts=self.context)
        experts.same_plan(pipe.plan, self.world)  # --ep, --cp: every line's all-to-alls in one order
        return pipe


def assemble(blocks: list[nn.Module], cut: Cut, world: World, recompute_mode: str = "none",
             reshard: bool = False, autocast: torch.dtype | None = None,
             weights: Callable[[dict[int, nn.Module], torch.device], None] | None = None,
             sequence_parallel: bool = True, compile: bool = False, float8: str = "",
             cp_method: str = "auto", chunked_loss: str = "auto", loss_chunk: int = 1024,
             adapters: lora.LoraSpec | None = None) -> Assembly:
    """This process's stages of `blocks`, cut by `cut`, wrapped for `world` in `ORDER`.

    Called by every process with the same blocks (built from one seed) and cut.

    Args:
        blocks: the whole model's blocks; changed in place (untied, wrapped).
        cut: the stages and their pipeline ranks.
        world: this process's place (`world.World`).
        recompute_mode: --recompute (a block may declare its own).
        reshard: with sharding, free a stage's gathered parameters after each forward; always so
            without a pipeline (one stage), where FSDP gathers and frees block by block.
        autocast: the run's precision, bf16 or fp16 (None: fp32): FSDP2's mixed precision where
            the stages are sharded, else the autocast dtype the pipeline runs under (`precision`).
        weights: `(held blocks, device) -> None`, called once every wrapper is in place, for
            blocks built on the meta device (an `hf:DIR` model): each process reads only its part.
        sequence_parallel: under tp > 1, split along the sequence what the blocks whose plan
            allows it would hold whole on every tp process (`parallel.sequence`).
        compile: compile each held block's forward (`parallel.compiled`).
        float8: a float8 recipe, tensorwise or rowwise ("": none; `parallel.float8`).
        cp_method: under --cp, how attention exchanges (`context.method_for`).
        chunked_loss: auto, on or off: the head's loss a chunk of `loss_chunk` positions at a
            time, where the last block is position-wise (`parallel.chunked`).
        adapters: --lora's adapters (`parallel.lora`); None: every weight trains.

    Raises:
        BrigadeError: a mode or plan a block refuses (`recompute.modes`, `tensor.parallelize`).
    """
    lines = world.tie_ranks() if not world.local and world.degrees.pp > 1 else None
    ties = StageTies(blocks, cut.balance, cut.ranks, lines)
    mine = [s for s, r in enumerate(cut.ranks) if world.local or r == world.coords.pp]
    indices = [b for s in mine for b in cut.blocks(s)]
    owned = OwnedBlocks(blocks, indices, ties.aliases)
    materialize(owned, world.device)  # blocks built without memory: only those held here
    owned.to(world.device)
    held = {i: blocks[i] for i in indices}
    converted = fp8.convert(blocks, float8, sharded(world), indices) if float8 else None  # 0. float8
    tp_mesh = world.tp_mesh if world.degrees.tp > 1 else None
    cp = _context(world, cp_method)
    modes = split_blocks(blocks, indices, tp_mesh, recompute_mode, sequence_parallel, cp)  # 1. and 2.
    if adapters is not None:  # 2b. LoRA (which refuses --float8)
        lora.apply(blocks, indices, adapters, float8)
    experts.split_experts([blocks[i] for i in indices], world)  # 3. expert parallel
    eager = compiled.compile_blocks(blocks, indices, modes) if compile else []  # 4. compile
    stages = split(blocks, list(cut.balance))
    run_under, mixed = precision(world, autocast)
    reshard = reshard or len(cut.ranks) == 1  # no pipeline: each block's weights freed after its forward
    wrapped = _local_stages(stages, cut, world) if world.local else \
        {s: _replicated(stages[s], world, reshard, mixed) for s in mine}  # 5. shard or replicate
    if weights is not None:  # after tensor parallel and sharding: each reads only its part
        weights(held, world.device)
    chunk = _chunk_head(blocks, cut, wrapped, tp_mesh, sequence_parallel, chunked_loss, loss_chunk,
                        run_under)
    return Assembly(world, cut, wrapped, held, owned, ties, modes, run_under, mixed, eager, converted, cp,
                    chunk)


def _chunk_head(blocks: list[nn.Module], cut: Cut, wrapped: dict[int, nn.Module], tp_mesh,
                sequence_parallel: bool, mode: str, size: int, autocast) -> chunked.Chunked | None:
    """The head's loss chunked on the last stage, where this process holds it (`chunked.install`):
    after every wrapper; under sequence parallel the head takes this process's part."""
    last, head = len(cut.ranks) - 1, blocks[-1]
    if last not in wrapped or not chunked.wanted(head, mode):
        return None
    tp = tp_mesh.size() if tp_mesh is not None else 1
    parts = tp if tp > 1 and sequence_parallel and sequence.takes_part(head, tensor.plan_at(head, tp)) else 1
    vocab_parts = tp if tensor.splits_vocab(head, tp) else 1
    return chunked.install(wrapped[last], head, size, mode, autocast, parts, vocab_parts)


def _context(world: World, method: str) -> context.ContextParallel | None:
    """Context parallel's cut, where --cp > 1, by `method` on this world's device."""
    if world.degrees.cp == 1:
        return None
    method = context.method_for(method, world.device.type)
    return context.ContextParallel(world.group("cp"), world.cp_mesh, method)


def split_blocks(blocks: list[nn.Module], indices: list[int], tp_mesh, recompute_mode: str,
                 sequence_parallel: bool = True, cp: context.ContextParallel | None = None) -> list[str]:
    """Wrappers 1 and 2 on the held blocks `indices`, in place: tensor parallel over `tp_mesh`
    (None: none), sequence parallel where a plan allows it and `sequence_parallel` asks, with the
    boundaries between parts and whole blocks; context parallel by `cp` (None: none); then
    recompute, and what a block without it saves made parts. Returns every block's recompute
    mode (`recompute.apply`). The planner measures a block on one tp process through this too
    (`planner.split_costs`)."""
    tp, parts = 1, [False] * len(blocks)
    if tp_mesh is not None:  # 1. tensor parallel, sequence parallel where it may
        tensor.parallelize([blocks[i] for i in indices], tp_mesh, sequence_parallel)
        tp = tp_mesh.size()
        parts = [sequence_parallel and sequence.takes_part(b, tensor.plan_at(b, tp)) for b in blocks]
        sequence.boundaries(blocks, parts, indices, tp_mesh)
    if cp is not None:  # 1b. context parallel
        context.apply(blocks, indices, cp, parts, tp)
    modes = recompute.apply(blocks, recompute_mode, held=indices)  # 2. recompute
    if tp_mesh is not None and sequence_parallel:  # what a block without recompute saves: parts
        _save_parts([blocks[i] for i in indices if modes[i] == "none"], tp_mesh)
    return modes


def _save_parts(blocks: list[nn.Module], mesh) -> None:
    """`sequence.save_parts` on the gathered modules of those of `blocks` that take part."""
    for block in blocks:
        plan = tensor.plan_at(block, mesh.size()) or {}
        if sequence.takes_part(block, plan):
            for name, entry in plan.items():
                if tensor.style_of(entry)[0] == "gather":
                    sequence.save_parts(block.get_submodule(name), mesh)


def sharded(world: World) -> bool:
    """Whether this world's stages go under FSDP2 (`Degrees.sharded`); never local stages."""
    return not world.local and world.degrees.sharded


def precision(world: World, dtype: torch.dtype | None) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(the pipeline's autocast dtype, the sharded stages' gathered-weight dtype) of a run at
    precision `dtype` (None: fp32): FSDP2's mixed precision where the stages are sharded, autocast
    elsewhere (the module docstring)."""
    return (None, dtype) if dtype is not None and sharded(world) else (dtype, None)


def _replicated(module: nn.Module, world: World, reshard: bool, mixed: torch.dtype | None) -> nn.Module:
    """`module` under FSDP2 over the world's shard mesh (`sharded`), gathering its weights as
    `mixed` where given, else under DDP over the data-parallel group, when the stage has replicas."""
    d = world.degrees
    if sharded(world):
        if d.ep > 1:  # the experts first: a unit of their own over the expert mesh's edp
            experts.shard_experts(module, world, reshard, shard_policy(mixed))
        return shard_stage(module, world.shard_mesh, reshard, mixed)
    if d.dp * d.cp == 1 or not any(p.requires_grad for p in module.parameters()):
        return module  # no replicas, or nothing to reduce (a stage --lora left without adapters)
    device = world.device
    return data_parallel(module, world.group("dpcp"), [device] if device.type == "cuda" else None,
                         ignore=experts.ignored_names(module))


def _local_stages(stages: list[nn.Module], cut: Cut, world: World) -> dict[int, nn.Module]:
    """Every stage on its pipeline rank's device; under DDP over a group of its own where the
    process has replicas (each device's thread issues its own stages' all-reduces)."""
    devices = [world.devices[r] for r in cut.ranks]
    if world.degrees.dp == 1:
        return {s: module.to(devices[s]) for s, module in enumerate(stages)}
    groups = [world.stage_group(d) for d in devices]  # every group first, in stage order
    out = {}
    for s, module in enumerate(stages):
        device = devices[s]
        if not any(p.requires_grad for p in module.parameters()):  # --lora left it no adapter
            out[s] = module.to(device)
            continue
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            out[s] = data_parallel(module.to(device), groups[s], [device] if device.type == "cuda" else None)
    return out
