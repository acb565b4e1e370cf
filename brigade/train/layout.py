"""Where each block runs, and how a batch becomes a loss and gradients in every layout.

    dp only       every process holds all blocks (a one-stage pipeline), DDP across processes
    pp only       one pipeline rank per process (Pipeline over point-to-point), holding one
                  stage, or --virtual V of them (interleaved, looped-bfs, zbv, dualpipev)
    dp × pp       a DeviceMesh (dp, pp): a pipeline per dp row, each stage DDP'd down its column
    dp × local-pp each process drives a LocalPipeline over `local_stages` devices; stage i of
                  every process forms its own DDP group (the tutorial's DDP with model parallel)
    × tp          a DeviceMesh (dp, pp, tp), tp innermost: each stage's blocks split over its tp
                  processes (parallel.tensor), which run the same schedule on the same inputs;
                  replicas then go through FSDP2 over (replicate, shard) of the same mesh, at
                  --shard 1 too (DDP takes no DTensor parameters)

Gradients are averaged over replicas once per step: by DDP's reducer on the last backward,
or, under zb/zbv/dualpipev (split I/W backward, which DDP cannot see) and whenever a rank holds several
stages, by the stage runner's `GradientReducer` on DDP's group, bucketed, started as soon as
that stage's last backward or weight pass is done.

Parameters keep layout-independent names (`blocks.3.attn.qkv.weight`): `owned` is a
module holding only this process's blocks under their global index. A parameter shared by
blocks on different stages (a tied embedding and head) is one copy per stage, kept equal by
summing their gradients after backward (ties.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from brigade import forensics
from brigade.config import ParallelConfig, pipeline_shape
from brigade.dtensors import local, mesh_of
from brigade.errors import BrigadeError
from brigade.host.cores import shared_cores
from brigade.launch import groups
from brigade.models.hf.weights import materialize
from brigade.parallel import recompute, tensor
from brigade.parallel.shard import shard_stage
from brigade.pipeline.pipe import LocalPipeline, Pipeline
from brigade.pipeline.plans.action import B, F, I, W
from brigade.pipeline.plans.generate import Costs
from brigade.pipeline.plans.schedule import SCHEDULES, placement
from brigade.pipeline.stages.partition import choose_balance, parse_balance, split
from brigade.pipeline.stages.ties import aliases, find_shared
from brigade.train.replicas import data_parallel, stage_group
from brigade.train.ties import StageTies


def _squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Σ of the tensors' squared norms, on `device` (one fused pass per device, as clip_grad_norm_ does)."""
    sq = torch.zeros((), device=device)
    for group in by_device(tensors):  # local-pp stages may sit on several GPUs
        sq = sq + torch.stack(torch._foreach_norm(group)).float().pow(2).sum().to(device)
    return sq


def by_device(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` grouped for one fused (`_foreach`) call each: by device, and by kind
    (`dtensors.mesh_of`: plain tensors, or DTensors of one mesh), which a fused op may not mix."""
    found: dict = {}
    for t in tensors:
        found.setdefault((t.device, mesh_of(t)), []).append(t)
    return list(found.values())


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
class Layout:
    dp: int
    pp: int
    dp_rank: int
    pp_rank: int
    dp_group: object
    pp_group: object
    device: torch.device
    shard: int = 1  # of the dp processes of a stage, how many shard it (1: DDP, or no dp)
    shard_mesh: object = None  # fully_shard's mesh: (shard), or (replicate, shard) under HSDP
    shard_group: object = None  # the processes holding the other shards of this one's copy
    tp: int = 1  # tensor-parallel processes per stage (1: none)
    tp_rank: int = 0
    tp_group: object = None
    tp_mesh: object = None  # parallelize_module's mesh, the "tp" dimension of the run's mesh


def make_layout(cfg: ParallelConfig, device: torch.device) -> Layout:
    """Process groups for dp × pp (× tp) over the current world (rank = dp_rank · pp + pp_rank).

    With --shard S the data-parallel rank is itself replicate · S + shard: a second mesh
    (replicate, shard, pp) over the same ranks gives fully_shard its data-parallel part.

        dp 4, shard 2, pp 2:  rank = (replicate · 2 + shard) · 2 + pp_rank
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if cfg.dp * cfg.pp * cfg.tp != world:
        tp = f" × tp {cfg.tp}" if cfg.tp > 1 else ""
        raise BrigadeError(
            f"dp {cfg.dp} × pp {cfg.pp}{tp} = {cfg.dp * cfg.pp * cfg.tp} but the world size is {world}: "
            f"the world size must equal dp × pp{' × tp' if cfg.tp > 1 else ''}"
        )
    from torch.distributed.device_mesh import init_device_mesh

    if cfg.tp > 1:
        return _tensor_parallel_layout(cfg, device)
    mesh = init_device_mesh(device.type, (cfg.dp, cfg.pp), mesh_dim_names=("dp", "pp"))
    layout = Layout(cfg.dp, cfg.pp, rank // cfg.pp, rank % cfg.pp, mesh["dp"].get_group(),
                    mesh["pp"].get_group(), device)
    if cfg.shard > 1:
        replicas = cfg.dp // cfg.shard
        full = init_device_mesh(device.type, (replicas, cfg.shard, cfg.pp),
                                mesh_dim_names=("replicate", "shard", "pp"))
        layout.shard = cfg.shard
        layout.shard_mesh = full["shard"] if replicas == 1 else full["replicate", "shard"]
        layout.shard_group = full["shard"].get_group()
    return layout


def _tensor_parallel_layout(cfg: ParallelConfig, device: torch.device) -> Layout:
    """`make_layout` under --tp: one mesh (replicate, shard, pp, tp), tp innermost.

        dp 2, pp 2, tp 2:  rank = (dp_rank · 2 + pp_rank) · 2 + tp_rank

    Tensor parallel and FSDP2 must take their meshes from one root for a parameter to become a
    DTensor over both; so the data-parallel part is (replicate, shard) of that root even at
    --shard 1, where FSDP2 only replicates (DDP takes no DTensor parameters). The (dp, pp, tp)
    mesh gives the groups the rest of the layout uses (the loss's mean, the pipeline's sends).
    """
    from torch.distributed.device_mesh import init_device_mesh

    rank, tp, pp = dist.get_rank(), cfg.tp, cfg.pp
    replicas = cfg.dp // cfg.shard
    root = init_device_mesh(device.type, (replicas, cfg.shard, pp, tp),
                            mesh_dim_names=("replicate", "shard", "pp", "tp"))
    mesh = init_device_mesh(device.type, (cfg.dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
    layout = Layout(cfg.dp, pp, rank // (pp * tp), rank // tp % pp, mesh["dp"].get_group(),
                    mesh["pp"].get_group(), device, tp=tp, tp_rank=rank % tp,
                    tp_group=root["tp"].get_group(), tp_mesh=root["tp"])
    if cfg.dp > 1:
        layout.shard = cfg.shard
        layout.shard_mesh = root["shard"] if replicas == 1 else root["replicate", "shard"]
        layout.shard_group = root["shard"].get_group()
    return layout


class ProcessModel:
    """This process's part of the model — its blocks, their pipeline and data-parallel wrappers —
    and how a batch runs through it (loss, gradients, gradient norm) in every layout.

    Args:
        blocks: the whole model as blocks (identical on every process).
        loss_fn: (output, target) -> mean loss.
        cfg: the parallel configuration; layout: process groups from `make_layout`.
        weights: `(held blocks, device) -> None`, called once every wrapper is in place, for
            blocks built on the meta device (an `hf:DIR` model): they get memory here, and
            `weights` fills them, a DTensor with only its own part.
    """

    def __init__(self, blocks: list[nn.Module], loss_fn, cfg: ParallelConfig, layout: Layout,
                 sample: torch.Tensor | None = None, autocast: torch.dtype | None = None,
                 weights=None):
        self.layout = layout
        self.reshard = cfg.reshard
        self.recompute = recompute.apply(blocks, cfg.recompute)  # before any wrapper (torchtitan's order)
        n_ranks, virtual = pipeline_shape(cfg)
        schedule = cfg.schedule if n_ranks > 1 else "gpipe"
        _, ranks = placement(schedule, n_ranks, virtual)
        balance = choose_balance(blocks, len(ranks), balance=parse_balance(cfg.balance) if cfg.balance
                                 else None)
        self.balance = balance
        self.local = cfg.local_stages > 1
        self.ties = StageTies(blocks, balance, ranks, layout.dp, layout.pp, self.local, layout.tp)
        stages = split(blocks, balance)
        starts = [sum(balance[:i]) for i in range(len(ranks))]
        mine = [s for s, r in enumerate(ranks) if self.local or r == layout.pp_rank]
        indices = [starts[s] + k for s in mine for k in range(balance[s])]
        self.owned = OwnedBlocks(blocks, indices, self.ties.aliases)
        materialize(self.owned, layout.device)  # blocks built without memory: only those held here
        self.owned.to(layout.device)
        if layout.tp > 1:  # before any data-parallel wrapper (torchtitan's order)
            tensor.parallelize([blocks[i] for i in indices], layout.tp_mesh)
        self.held = {i: blocks[i] for i in indices}
        m = cfg.microbatches if n_ranks > 1 else 1
        # A costed schedule (auto) plans on unit costs until `replan` gives it measured ones.
        self.costed = SCHEDULES[schedule].costed
        self.limit, self.n_stages = cfg.auto_limit, len(ranks)
        self.cores = self._shared_cores(n_ranks, cfg) if self.costed else 0.0
        costs = Costs.unit(len(ranks), cfg.auto_limit) if self.costed else None
        if self.local:
            self.pipe = self._local_pipeline(stages, ranks, cfg, loss_fn, m, autocast, costs)
        else:
            modules = {s: self._replicated(stages[s]) for s in mine}
            self.pipe = Pipeline(modules, schedule, m, loss_fn, group=layout.pp_group, device=layout.device,
                                 autocast=autocast, virtual=virtual, costs=costs)
        if weights is not None:  # after tensor parallel and sharding: each reads only its part
            weights(self.held, layout.device)

    def _shared_cores(self, n_ranks: int, cfg: ParallelConfig) -> float:
        """The cores the pipeline's ranks share, where fewer than they need (`host.cores`), agreed by
        every process (the least any reports): every process must plan the same."""
        per_process = cfg.local_stages if self.local else 1
        on_host = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) * per_process
        mine = shared_cores(n_ranks, on_host, torch.get_num_threads(), self.layout.device.type)
        agreed = torch.tensor([mine or float("inf")], dtype=torch.float64, device=self.layout.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            forensics.doing("allreduce the host's shared cores", waiting=True)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        least = agreed.item()
        return 0.0 if least == float("inf") else least

    def _replicated(self, module: nn.Module) -> nn.Module:
        """`module` under FSDP2 over the layout's shard mesh (--shard), else under DDP over this
        stage's data-parallel group, when there are replicas."""
        if self.layout.shard_mesh is not None:
            return shard_stage(module, self.layout.shard_mesh, self.reshard)
        if self.layout.dp == 1:
            return module
        device = self.layout.device
        return data_parallel(module, self.layout.dp_group, [device] if device.type == "cuda" else None)

    def _local_pipeline(self, stages, ranks: list[int], cfg: ParallelConfig, loss_fn, m: int, autocast,
                        costs: Costs | None = None):
        layout = self.layout
        n = cfg.local_stages
        devices = groups.local_devices(layout.device.type, int(os.environ.get("LOCAL_RANK", 0)), n)
        if devices[0] != layout.device:
            raise BrigadeError(f"the process group is bound to {layout.device} but stage 0 of "
                               f"--local-stages {n} runs on {devices[0]}: pass local_stages={n} to "
                               "brigade.launch.groups.init and brigade.launch.groups.info")
        # One process group per stage: each device's thread issues its own stages' all-reduces.
        stage_groups = [stage_group(devices[r]) for r in ranks] if layout.dp > 1 else None

        def wrap(s: int, module: nn.Module) -> nn.Module:
            if stage_groups is None:
                return module
            device = devices[ranks[s]]
            if device.type != "cuda":
                return data_parallel(module, stage_groups[s], None)
            with torch.cuda.device(device):  # DDP's first broadcast, on stage s's GPU
                return data_parallel(module, stage_groups[s], [device])

        return LocalPipeline(stages, devices, cfg.schedule, m, loss_fn, wrap=wrap, autocast=autocast,
                             virtual=len(ranks) // n, costs=costs)

    def forward_backward(self, x, y, loss_scale: float, sync: bool, trace: bool = False) -> torch.Tensor:
        """This batch's mean loss, averaged over data-parallel replicas, on every process.

        With `sync` (the step's last chunk) the copies of a shared parameter then hold the sum
        of their gradients. `trace`: time every action (what `replan` reads).
        """
        loss = self.pipe.step(x, y, loss_scale=loss_scale, sync=sync, trace=trace)
        if sync:
            self.ties.sum_grads(self.held)
        return self._dp_mean(loss)

    @torch.no_grad()
    def evaluate(self, x, y) -> torch.Tensor:
        return self._dp_mean(self.pipe.evaluate(x, y))

    def _dp_mean(self, loss: torch.Tensor) -> torch.Tensor:
        loss = loss.to(self.layout.device)
        if self.layout.dp > 1:
            forensics.doing("allreduce loss over replicas", waiting=True)
            dist.all_reduce(loss, group=self.layout.dp_group)
            loss = loss / self.layout.dp
        return loss

    def replan(self) -> Costs:
        """Plan a costed schedule again on the seconds its last traced step took, every stage's
        median over micro-batches and over the processes that ran it, agreed by every process
        (one all-reduce), on the cores the ranks share where the host has too few (`host.cores`: 4
        CPU processes on 2 cores favour a whole backward). Each stage keeps its micro-batch
        order: the new plan sums the same gradients in the same order, so the run's numbers do
        not change, only its speed."""
        kinds = (F, I, W, B)
        table = torch.zeros(2, self.n_stages, len(kinds), dtype=torch.float64, device=self.layout.device)
        for (s, op), seconds in self.pipe.timings().items():
            table[:, s, kinds.index(op)] = torch.tensor([seconds, 1.0], dtype=torch.float64)
        forensics.doing("allreduce the stages' timings", waiting=True)
        dist.all_reduce(table)
        mean = (table[0] / table[1].clamp(min=1)).tolist()
        costs = Costs.measured({(s, op): mean[s][k] for s in range(self.n_stages)
                                for k, op in enumerate(kinds)}, self.n_stages, self.limit, self.cores)
        self.pipe.replan(costs)
        return costs

    def grads(self) -> list[torch.Tensor]:
        """Every gradient held here, each copy of a shared parameter included (to scale them alike)."""
        return [p.grad for p in self.owned.parameters() if p.grad is not None]

    def grad_norm(self) -> torch.Tensor:
        """The whole model's gradient norm (all stages, a shared parameter once), on every process."""
        once = [p.grad for name, p in self.owned.named_parameters()
                if p.grad is not None and name not in self.owned.aliases]
        split = [g for g in once if tensor.is_tp_sharded(g)]  # a part on each tp process
        sq = _squares([local(g) for g in once if not tensor.is_tp_sharded(g)], self.layout.device)
        if self.layout.tp_group is not None:
            parts = _squares([local(g) for g in split], self.layout.device)
            forensics.doing("allreduce gradient norm over tensor-parallel processes", waiting=True)
            dist.all_reduce(parts, group=self.layout.tp_group)
            sq = sq + parts
        if self.layout.shard_group is not None:  # each shard of a copy once (not per replica)
            forensics.doing("allreduce gradient norm over shards", waiting=True)
            dist.all_reduce(sq, group=self.layout.shard_group)
        if self.layout.pp > 1:
            forensics.doing("allreduce gradient norm over stages", waiting=True)
            dist.all_reduce(sq, group=self.layout.pp_group)
        return sq.sqrt()

    def close(self) -> None:
        if self.local:
            self.pipe.close()
