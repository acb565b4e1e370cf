"""This process's part of the model in every layout, and how a batch becomes a loss and gradients.

    dp only       every process holds all blocks (a one-stage pipeline), DDP across processes
    pp only       one pipeline rank per process (Pipeline over point-to-point), holding one
                  stage, or --virtual V of them (interleaved, looped-bfs, zbv, dualpipev)
    dp × pp       a pipeline per data-parallel replica, each stage DDP'd over its replicas
    dp × local-pp each process drives a LocalPipeline over `local_stages` devices; stage i of
                  every process forms its own DDP group (the tutorial's DDP with model parallel)
    × tp          each stage's blocks split over its tp processes (parallel.tensor), which run
                  the same schedule on the same inputs; replicas then go through FSDP2, at
                  --shard 1 too (DDP takes no DTensor parameters)

Where each process sits, and its groups, is the world's (`world.World`, built by `world_of`); the
stages are cut here (`cut_of`) and wrapped by the one assembler (`parallel.assemble`), the code
`brigade check` proves. Gradients are averaged over replicas once per step: by DDP's reducer on
the last backward, or, under zb/zbv/dualpipev (split I/W backward, which DDP cannot see) and
whenever a rank holds several stages, by the stage runner's `GradientReducer` on DDP's group,
bucketed, started as soon as that stage's last backward or weight pass is done.

Parameters keep layout-independent names (`blocks.3.attn.qkv.weight`): `owned` is a module
holding only this process's blocks under their global index. A parameter shared by blocks on
different stages (a tied embedding and head) is one copy per stage, kept equal by summing their
gradients after backward (`pipeline.stages.ties.StageTies`).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from brigade import forensics
from brigade.config import ParallelConfig, degrees_of, pipeline_shape
from brigade.dtensors import local, mesh_of
from brigade.errors import BrigadeError
from brigade.host.cores import shared_cores
from brigade.launcher import groups
from brigade.models import moe
from brigade.parallel import experts, tensor
from brigade.parallel.assemble import Cut, assemble, sharded
from brigade.pipeline.batches.microbatch import batch_size_of
from brigade.pipeline.plans.action import B, F, I, W
from brigade.pipeline.plans.costs import Costs
from brigade.pipeline.plans.schedule import SCHEDULES, build, placement
from brigade.pipeline.stages.measured_cut import MEASURED, auto_balance
from brigade.pipeline.stages.partition import choose_balance, parse_balance
from brigade.world.mesh import World


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


def world_of(cfg: ParallelConfig, device: torch.device) -> World:
    """This process's world for a resolved configuration (dp set): its degrees, and under
    --local-stages the devices it drives (`launcher.groups.local_devices`, stage 0's on `device`).

    Raises:
        BrigadeError: degrees that do not make the process group's world; local stages whose
            first device is not the one the process group is bound to.
    """
    devices = None
    if cfg.local_stages > 1:
        n = cfg.local_stages
        devices = groups.local_devices(device.type, int(os.environ.get("LOCAL_RANK", 0)), n)
        if devices[0] != device:
            raise BrigadeError(f"the process group is bound to {device} but stage 0 of "
                               f"--local-stages {n} runs on {devices[0]}: pass local_stages={n} to "
                               "brigade.launcher.groups.init and brigade.launcher.groups.info")
    return World(degrees_of(cfg), device, devices)


def cut_of(blocks: list[nn.Module], cfg: ParallelConfig, sample=None, cores: float = 0.0,
           device: torch.device | None = None) -> tuple[Cut, str, int, bool]:
    """(the cut, the schedule, micro-batches, whether the cut was measured) a run's configuration
    gives: blocks per stage by --balance; with --balance measured (a costed schedule: auto), the
    cut auto's plan runs best on, from the blocks' times on the `sample` micro-batch measured
    here (`measured_cut.auto_balance`, on `device`, planned for `cores` shared cores); else by
    parameters. Stages placed by the schedule; one stage under GPipe with one micro-batch where
    there is no pipeline.

    Measuring is asked for, not the default: two runs measure two cuts where the blocks' times
    are close, and a different cut draws each stage's dropout masks and sums its gradients in
    another order, so the same command would no longer repeat its numbers. A measured cut is
    kept in the run's snapshots, and a resume cuts by it (`train.run.resumed_cut`)."""
    n_ranks, virtual = pipeline_shape(cfg)
    schedule = cfg.schedule if n_ranks > 1 else "gpipe"
    _, ranks = placement(schedule, n_ranks, virtual)
    measured = cfg.balance == MEASURED and sample is not None and n_ranks > 1 and SCHEDULES[schedule].costed
    given = parse_balance(cfg.balance) if cfg.balance and cfg.balance != MEASURED else None
    if measured:
        balance = auto_balance(blocks, sample, n_ranks, virtual, cfg.microbatches, cfg.auto_limit, cores,
                               device)
    else:
        balance = choose_balance(blocks, len(ranks), balance=given)
    return Cut(tuple(balance), tuple(ranks)), schedule, cfg.microbatches if n_ranks > 1 else 1, measured


class ProcessModel:
    """This process's part of the model — its blocks, wrapped by the assembler, and their
    pipeline — and how a batch runs through it (loss, gradients, gradient norm) in every layout.

    Args:
        blocks: the whole model as blocks (identical on every process).
        sample: one micro-batch of inputs, for a costed schedule without --balance to measure its
            cut on (`cut_of`); None: the parameter cut.
        loss_fn: (output, target) -> mean loss.
        cfg: the parallel configuration; world: this process's place (`world_of`).
        weights: `(held blocks, device) -> None`, called once every wrapper is in place, for
            blocks built on the meta device (an `hf:DIR` model): they get memory there, and
            `weights` fills them, a DTensor with only its own part.
        adapters: --lora's adapters (`parallel.lora.LoraSpec`); None: every weight trains.
    """

    def __init__(self, blocks: list[nn.Module], loss_fn, cfg: ParallelConfig, world: World,
                 autocast: torch.dtype | None = None, weights=None, sample=None, adapters=None):
        self.world = world
        n_ranks = pipeline_shape(cfg)[0]
        costed = n_ranks > 1 and SCHEDULES[cfg.schedule].costed
        self.cores = self._shared_cores(n_ranks, cfg) if costed else 0.0
        cut, schedule, m, self.measured_cut = cut_of(blocks, cfg, sample, self.cores, world.device)
        if self.measured_cut and (not dist.is_initialized() or dist.get_rank() == 0):
            cut_text = ",".join(map(str, cut.balance))
            print(f"brigade: --balance measured: --schedule {schedule} cuts the blocks {list(cut.balance)}, "
                  f"chosen with its plan (--balance {cut_text} repeats it)", flush=True)
        self.assembly = assemble(blocks, cut, world, cfg.recompute, cfg.reshard, autocast, weights,
                                 cfg.sequence_parallel, cfg.compile, cfg.float8, cfg.cp_method,
                                 cfg.chunked_loss, cfg.loss_chunk, adapters)
        if self.assembly.float8 is not None and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f"brigade: {self.assembly.float8.line()}", flush=True)
        self.balance, self.owned, self.held = list(cut.balance), self.assembly.owned, self.assembly.held
        self.ties, self.recompute = self.assembly.ties, self.assembly.modes
        # A costed schedule (auto) plans on unit costs until `replan` gives it measured ones.
        self.costed = SCHEDULES[schedule].costed
        self.limit, self.n_stages = cfg.auto_limit, len(cut.ranks)
        costs = Costs.unit(self.n_stages, cfg.auto_limit) if self.costed else None
        self.pipe = self.assembly.pipeline(schedule, m, loss_fn, costs)
        if cfg.compile and (not dist.is_initialized() or dist.get_rank() == 0):
            self._say_unsplit(schedule, len(set(cut.ranks)), m, cut.virtual)

    @staticmethod
    def _say_unsplit(schedule: str, ranks: int, m: int, virtual: int) -> None:
        """Under a schedule that splits backwards into I and W, say once that compiled blocks do
        not (`runtime.backward`): their W is done at I, so the plan's W actions fill nothing."""
        costs = Costs.unit(ranks * virtual) if SCHEDULES[schedule].costed else None
        if any(a.op == W for acts in build(schedule, ranks, m, virtual, costs).values() for a in acts):
            print(f"brigade: --compile under {schedule}: a compiled block's backward is one graph, so "
                  "compiled blocks compute their weight gradients with their input gradients (I), "
                  "and their W actions only mark them ready", flush=True)

    def _shared_cores(self, n_ranks: int, cfg: ParallelConfig) -> float:
        """The cores the pipeline's ranks share, where fewer than they need (`host.cores`), agreed by
        every process (the least any reports): every process must plan the same."""
        per_process = cfg.local_stages if self.world.local else 1
        on_host = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) * per_process
        mine = shared_cores(n_ranks, on_host, torch.get_num_threads(), self.world.device.type)
        agreed = torch.tensor([mine or float("inf")], dtype=torch.float64, device=self.world.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            forensics.doing("allreduce the host's shared cores", waiting=True)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        least = agreed.item()
        return 0.0 if least == float("inf") else least

    def forward_backward(self, x, y, loss_scale: float, sync: bool, trace: bool = False) -> torch.Tensor:
        """This batch's mean loss, averaged over data-parallel replicas, on every process.

        With `sync` (the step's last chunk) the copies of a shared parameter then hold the sum
        of their gradients, and sequence parallel's partial ones their sum over tp
        (`Assembly.settle_grads`). `trace`: time every action (what `replan` reads).
        """
        moe.per_step(self.assembly.held.values(), batch_size_of(x) / loss_scale)  # its balancing loss
        loss = self.pipe.step(x, y, loss_scale=loss_scale, sync=sync, trace=trace)
        if sync:
            self.assembly.settle_grads()
        return self._dp_mean(loss)

    @torch.no_grad()
    def evaluate(self, x, y) -> torch.Tensor:
        return self._dp_mean(self.pipe.evaluate(x, y))

    def _dp_mean(self, loss: torch.Tensor) -> torch.Tensor:
        loss = loss.to(self.world.device)
        dp = self.world.degrees.dp
        if dp > 1:
            forensics.doing("allreduce loss over replicas", waiting=True)
            dist.all_reduce(loss, group=self.world.group("dp"))
            loss = loss / dp
        return loss

    def replan(self) -> Costs:
        """Plan a costed schedule again on the seconds its last traced step took, every stage's
        median over micro-batches and over the processes that ran it, agreed by every process
        (one all-reduce), on the cores the ranks share where the host has too few (`host.cores`: 4
        CPU processes on 2 cores favour a whole backward). Each stage keeps its micro-batch
        order: the new plan sums the same gradients in the same order, so the run's numbers do
        not change, only its speed."""
        kinds = (F, I, W, B)
        table = torch.zeros(2, self.n_stages, len(kinds), dtype=torch.float64, device=self.world.device)
        for (s, op), seconds in self.pipe.timings().items():
            table[:, s, kinds.index(op)] = torch.tensor([seconds, 1.0], dtype=torch.float64)
        forensics.doing("allreduce the stages' timings", waiting=True)
        dist.all_reduce(table)
        mean = (table[0] / table[1].clamp(min=1)).tolist()
        costs = Costs.measured({(s, op): mean[s][k] for s in range(self.n_stages)
                                for k, op in enumerate(kinds)}, self.n_stages, self.limit, self.cores)
        self.pipe.replan(costs)
        experts.same_plan(self.pipe.plan, self.world)
        return costs

    def after_optimizer_step(self) -> None:
        """Once the optimizer changed the weights (`Assembly.after_optimizer_step`)."""
        self.assembly.after_optimizer_step()

    def grads(self) -> list[torch.Tensor]:
        """Every gradient held here, each copy of a shared parameter included (to scale them alike)."""
        return [p.grad for p in self.owned.parameters() if p.grad is not None]

    def grad_norm(self) -> torch.Tensor:
        """The whole model's gradient norm (all stages, a shared parameter once), on every process."""
        held = [p for name, p in self.owned.named_parameters()
                if p.grad is not None and name not in self.owned.aliases]
        once = [p.grad for p in held if not experts.is_expert(p)]
        split = [g for g in once if tensor.is_tp_sharded(g)]  # a part on each tp process
        world, d = self.world, self.world.degrees
        sq = _squares([local(g) for g in once if not tensor.is_tp_sharded(g)], world.device)
        if d.ep > 1:  # each process its own experts (and their shards): summed over those apart
            mine = _squares([local(p.grad) for p in held if experts.is_expert(p)], world.device)
            forensics.doing("allreduce gradient norm over expert groups", waiting=True)
            dist.all_reduce(mine, group=experts.norm_group(world, sharded(world)))
        else:
            mine = None
        if d.tp > 1:
            parts = _squares([local(g) for g in split], world.device)
            forensics.doing("allreduce gradient norm over tensor-parallel processes", waiting=True)
            dist.all_reduce(parts, group=world.group("tp"))
            sq = sq + parts
        if sharded(world) and d.fsdp > 1:  # each shard of a copy once (not per replica): shard × cp
            forensics.doing("allreduce gradient norm over shards", waiting=True)
            dist.all_reduce(sq, group=world.shard_group)
        if mine is not None:
            sq = sq + mine
        if d.pp > 1:
            forensics.doing("allreduce gradient norm over stages", waiting=True)
            dist.all_reduce(sq, group=world.group("pp"))
        return sq.sqrt()

    def close(self) -> None:
        if self.world.local:
            self.pipe.close()
