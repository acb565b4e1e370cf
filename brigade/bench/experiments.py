"""The tutorial's experiment, per configuration, on 2 devices (2 processes, one thread each).

    single           rank 0 alone runs the whole model on the whole batch
    model parallel   2 stages, no micro-batching (m = 1)
    brigade          each schedule × its stages per rank (V) × a sweep of split sizes
    torch            torch.distributed.pipelining: every schedule the installed torch offers
                     (`peers.TORCH_SCHEDULES`) at the same p, V and m, on the same stages
    ddp              DistributedDataParallel over the same 2 devices, half the batch each

brigade's rows and the DDP row are built by the stage assembler `brigade train` uses
(`parallel.assemble`), over the worker's two worlds of the same processes: one pipeline of them
all, and as many data-parallel replicas (`world.World`).

Each row runs on a cut of the blocks into stages (a `Shape`): for a V and m, every row shares the
solver's cut, torch's rows too, except `auto`'s, which chooses its own with its plan from the same
measured per-block costs (`plans.cuts.choose_cut`; bench.json's "cut_search" says how it compares).

Every configuration is built first, then timed in interleaved rounds
(`timing.interleaved_rounds`): each round times each configuration once, so drift on a
shared machine hits all alike. Each round also measures every stage's per-micro-batch costs
(a probe per m), from which `simulate()` gives that round's ideal step; ratios (vs single, vs
the torch twin, ideal ÷ measured) are taken per round and summarised by `bench.figures`.
Models, batches and every collective's tensors live on the process's device.

With --compile every row runs compiled blocks, torch's too: each copy of the blocks is compiled as
it is made (`copy_blocks`), once, before any row is built on it, and the solver's and auto's
costs are measured on compiled copies as well. A block is never copied after it is compiled: the
copy's `forward` would still be the original's, bound to the original's parameters. Compiling
happens in each step's untimed warm-up (`timing.interleaved_rounds`), never in a timed round.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from brigade.bench.cases import DDP, MP, OURS, PEER, SINGLE, BenchConfig, Case, Shape, cases, shape_of
from brigade.bench.copies import copy_blocks
from brigade.bench.peers import TORCH_SCHEDULES, TorchPipelining, local_stages
from brigade.errors import BrigadeError
from brigade.host import malloc
from brigade.host.cores import shared_cores
from brigade.launcher import groups
from brigade.measure.activations import stage_meter
from brigade.measure.device import place_model
from brigade.measure.stages import block_costs, gathered_stage_costs
from brigade.measure.timing import interleaved_rounds, pipeline_step, train_step
from brigade.models import load_model
from brigade.parallel.assemble import Cut, assemble
from brigade.pipeline.pipe import Pipeline
from brigade.pipeline.plans.costs import Costs
from brigade.pipeline.plans.cuts import Choice, choose_cut
from brigade.pipeline.plans.schedule import SCHEDULES, placement, stages_on
from brigade.pipeline.stages.partition import choose_balance, solve, split
from brigade.train.memory import storage_bytes
from brigade.world.degrees import Degrees
from brigade.world.mesh import World


@dataclass
class Worker:
    """What a bench or tuner worker builds its steps from: the run, the model, the batch, its rank,
    and its two worlds over the same processes (`worlds`): `pipeline`, one pipeline rank each;
    `replicas`, one data-parallel replica each."""

    cfg: BenchConfig
    spec: object
    x: torch.Tensor
    y: torch.Tensor
    rank: int
    ranks: int
    pipeline: World | None = None
    replicas: World | None = None

    def copy_blocks(self) -> list[nn.Module]:
        """A fresh copy of the model's blocks for one row, compiled under --compile (`copy_blocks`)."""
        return copy_blocks(self.spec.blocks, self.cfg.compile)


def worlds(ranks: int, device: torch.device) -> tuple[World, World]:
    """(a pipeline of `ranks` ranks, `ranks` data-parallel replicas): the two layouts a bench or tune
    worker builds its rows on, made in this order on every process."""
    return World(Degrees(pp=ranks), device), World(Degrees(dp=ranks), device)


def replica_step(w: Worker):
    """One DDP step of the whole model, each replica on its slice of the batch, wrapped as
    `brigade train` wraps it (the stage assembler over the `replicas` world), compiled already
    under --compile (`Worker.copy_blocks`)."""
    blocks = w.copy_blocks()
    (model,) = assemble(blocks, Cut((len(blocks),), (0,)), w.replicas).stages.values()
    d, c = w.replicas.degrees, w.replicas.coords
    return train_step(model, w.spec.loss_fn, w.x.chunk(d.dp)[c.dp], w.y.chunk(d.dp)[c.dp])


def brigade_pipeline(w: Worker, blocks: list[nn.Module], balance: list[int], schedule: str, virtual: int,
                     m: int, costs: Costs | None = None) -> tuple[Pipeline, nn.ModuleList]:
    """brigade's pipeline of `schedule` over the `pipeline` world, its stages cut from `blocks` by
    `balance` and built by the stage assembler; and this rank's stages (what a step's gradients
    are zeroed on). `blocks` come compiled under --compile (`Worker.copy_blocks`): the assembler
    does not compile them again."""
    cut = Cut(tuple(balance), tuple(placement(schedule, w.ranks, virtual)[1]))
    built = assemble(blocks, cut, w.pipeline)
    return built.pipeline(schedule, m, w.spec.loss_fn, costs), nn.ModuleList(built.stages.values())


@dataclass
class _Bench(Worker):
    balances: dict[Shape, list[int]] = field(default_factory=dict)  # the cut of each shape
    blocks: dict[Shape, list[nn.Module]] = field(default_factory=dict)  # a copy of the blocks (shared)
    stages: dict[Shape, list[nn.Module]] = field(default_factory=dict)  # its stages
    pipes: dict[Case, tuple[Pipeline, nn.Module]] = field(default_factory=dict)  # brigade's rows
    plan_costs: dict[Shape, Costs] = field(default_factory=dict)  # what auto plans on


def _agreed_balances(b: Worker, shapes: list[Shape]) -> tuple[dict[Shape, list[int]], dict[Shape, dict]]:
    """(each shape's cut, auto's cut searches), rank 0's (both systems run the same stages).

    The solver's cut balances the blocks' measured forward + backward over ranks × V stages, timed
    at that m's micro-batch: a block's cost is not proportional to its batch (ResNet-50's last
    blocks cost 2x the earlier ones at 16 images and 7x at 4, where reading their weights
    dominates; cut at 16, GPipe at m = 8 ran 1.35x slower). A costed schedule's shape gets the cut
    `choose_cut` keeps from the same costs, seeded with the solver's (transfers free, as in the
    rows' `ideal`; on the host's shared cores, as its plan is made). Every rank measures at
    once, as all compute in a step; only rank 0 searches.
    """
    size = {m: math.ceil(len(b.x) / m) for _, m, _ in shapes}  # micro-batch of each m
    costs = {n: block_costs(b.copy_blocks(), b.x[:n], b.spec.loss_fn, b.y[:n])
             for n in sorted(set(size.values()))}
    cores = shared_cores(b.ranks, b.ranks, torch.get_num_threads(), b.x.device.type)  # one host
    mine: dict[Shape, list[int]] = {}
    found: dict[Shape, dict] = {}
    for v, m, own in shapes if b.rank == 0 else ():
        given = b.cfg.balance if v == 1 else None  # the config's cut is for one stage per rank
        if given:
            mine[v, m, own] = choose_balance(b.spec.blocks, b.ranks, balance=given)
            continue
        mine[v, m, own] = solve([f + bw for f, bw, *_ in costs[size[m]]], b.ranks * v)
        if own:
            got = choose_cut(costs[size[m]], b.ranks, m, (v,), given=[mine[v, m, own]], cores=cores)
            found[v, m, own] = search_record(got, mine[v, m, own])
            mine[v, m, own] = list(got.balance)
    agreed = [(mine, found)]
    dist.broadcast_object_list(agreed, src=0)
    return agreed[0]


def search_record(got: Choice, solver: list[int]) -> dict:
    """What bench.json says of a cut search: the cut kept against the solver's, each one's step
    as `simulate()` gives auto's plan on the blocks' measured costs, the kept cut's lower bound,
    and how far the search went (`Choice`)."""
    return {"cut": list(got.balance), "solver_cut": list(solver), "simulated_s": got.score,
            "solver_simulated_s": got.given, "lower_bound_s": got.bound, "screened": got.screened,
            "weighed": got.weighed, "proven": got.proven}


def _cut(b: _Bench) -> None:
    """Each shape -> a copy of the blocks for its balance, and its stages (for torch's rows and the
    probes; brigade's rows cut the same copy through the assembler); equal balances share one.
    Under --compile each copy is compiled as it is made, once for every row on it."""
    made: dict[tuple[int, ...], tuple[list[nn.Module], list[nn.Module]]] = {}
    for shape, balance in b.balances.items():
        if tuple(balance) not in made:  # one deep copy per distinct cut, not per shape
            blocks = b.copy_blocks()
            made[tuple(balance)] = blocks, split(blocks, balance)
        b.blocks[shape], b.stages[shape] = made[tuple(balance)]


def _ours(b: _Bench, case: Case):
    shape = shape_of(case)
    pipe, mine = brigade_pipeline(b, b.blocks[shape], b.balances[shape], case.schedule, case.virtual,
                                  case.microbatches, b.plan_costs.get(shape))
    b.pipes[case] = pipe, mine
    return pipeline_step(pipe, mine, b.x, b.y)


def _step(b: _Bench, case: Case):
    """The callable every rank runs for one timed step of `case` (built now, timed later)."""
    if case.name == SINGLE:
        if b.rank != 0:
            return lambda: None
        return train_step(nn.Sequential(*b.copy_blocks()), b.spec.loss_fn, b.x, b.y)
    if case.name == DDP:
        return replica_step(b)
    if case.name in (OURS, MP):
        return _ours(b, case)
    stages, placement = b.stages[shape_of(case)], TORCH_SCHEDULES[case.schedule].placement
    mine = {s: stages[s] for s in local_stages(placement, b.rank, b.ranks, case.virtual)}
    peer = TorchPipelining(mine, len(stages), case.schedule, case.microbatches, b.spec.loss_fn, b.x.device)
    return pipeline_step(peer, peer.module, b.x, b.y)


def measured_costs(b: _Bench, todo: list[Case]) -> dict[Shape, Costs]:
    """Shape -> every stage's measured costs, for the costed schedules' rows (auto plans on them):
    each rank times the stages it holds, all at once (3 repeats, the median), gathered. Transfers
    are left at 0, as in the rows' `ideal` (`figures`). Where the ranks outnumber the host's
    cores, the costs say so (`host.cores`) and each rank measures alone in turn (`turns`)."""
    out: dict[Shape, Costs] = {}
    cores = shared_cores(b.ranks, b.ranks, torch.get_num_threads(), b.x.device.type)  # one host
    for c in todo:
        v, m, shape = c.virtual, c.microbatches, shape_of(c)
        if c.name != OURS or not SCHEDULES[c.schedule].costed or shape in out:
            continue
        held = stages_on(c.schedule, b.ranks, b.rank, v)
        fwd, bwd, wgt, inp = gathered_stage_costs(b.stages[shape], b.rank, b.x, b.y, b.spec.loss_fn, m,
                                                  repeats=3, held=held, turns=cores > 0)
        out[shape] = Costs(tuple(fwd), tuple(inp), tuple(wgt), backward=tuple(bwd), cores=cores)
    return out


def _probe(b: _Bench, shape: Shape, into: list):
    """A round's measurement of every stage's (forward, backward, weight) costs at m micro-batches,
    for the model cut into ranks × V stages as `shape` cuts it (each rank measures V at once)."""
    virtual, m, _ = shape
    held = [s for s in range(b.ranks * virtual) if s % b.ranks == b.rank]

    def probe() -> None:
        into.append(gathered_stage_costs(b.stages[shape], b.rank, b.x, b.y, b.spec.loss_fn, m,
                                         repeats=1, held=held))
    return probe


def _steps(b: _Bench, todo: list[Case], skipped: list[dict]) -> dict:
    """Every case's step, built on every rank in the same order; a case its library refuses
    (the same on every rank: the rules are pure) goes to `skipped` with the library's words."""
    steps = {}
    for case in todo:
        try:
            steps[case.key] = _step(b, case)
        except (BrigadeError, ValueError) as exc:
            skipped.append({**asdict(case), "reason": str(exc).splitlines()[0]})
    return steps


def _memory(b: _Bench, case: Case) -> tuple[list[float], str, list[float], list[float]]:
    """Every stage's activation peak in one step of brigade's `case`, the meter's method, and every
    stage's parameter and gradient bytes (`train.memory.storage_bytes`), gathered."""
    pipe, module = b.pipes[case]
    params = list(module.parameters())
    meter = stage_meter(b.x.device, exclude=params)
    with meter:
        pipe.step(b.x, b.y)
    mine = [float(meter.peak_bytes), storage_bytes(params), storage_bytes(p.grad for p in params)]
    module.zero_grad(set_to_none=True)
    got = [torch.zeros(3, dtype=torch.float64, device=b.x.device) for _ in range(b.ranks)]
    dist.all_gather(got, torch.tensor(mine, dtype=torch.float64, device=b.x.device))
    return [g[0].item() for g in got], meter.method, [g[1].item() for g in got], [g[2].item() for g in got]


def _trace(b: _Bench, case: Case) -> dict:
    """One traced step of brigade's `case`: every rank's (action, start, end) on one clock."""
    (pipe, module), device = b.pipes[case], b.x.device
    dist.barrier()
    pipe.step(b.x, b.y, trace=True)
    module.zero_grad(set_to_none=True)
    t0 = torch.tensor([min(s for _, s, _ in pipe.last_result.trace)], dtype=torch.float64, device=device)
    dist.all_reduce(t0, op=dist.ReduceOp.MIN)  # perf_counter is system-wide on Linux
    events = [(str(a), s - t0.item(), e - t0.item()) for a, s, e in pipe.last_result.trace]
    gathered: list = [None] * b.ranks
    dist.all_gather_object(gathered, events)
    return {"schedule": case.schedule, "virtual": case.virtual, "microbatches": case.microbatches,
            "events": gathered}


def worker(cfg: BenchConfig) -> dict:
    """Build every configuration, time them in interleaved rounds, then memory and one trace."""
    info = groups.init(cfg.backend, threads=1)
    result = _measure(cfg, info)
    groups.destroy()  # every step (DDP's reducer, the pipelines) is gone first: see there
    return result


def _measure(cfg: BenchConfig, info) -> dict:
    """The worker's body: everything it builds is freed when this returns."""
    spec = load_model(cfg.model, seed=cfg.seed, **cfg.model_options)
    x, y = place_model(spec, cfg.batch_size, cfg.seed, info.device)
    todo, skipped = cases(cfg, info.world_size, len(spec.blocks))
    shapes = sorted({shape_of(c) for c in todo if c.name in (MP, OURS, PEER)})
    pipeline, replicas = worlds(info.world_size, info.device)
    b = _Bench(cfg, spec, x, y, info.rank, info.world_size, pipeline, replicas)
    b.balances, searches = _agreed_balances(b, shapes)
    _cut(b)
    b.plan_costs = measured_costs(b, todo)
    steps = _steps(b, todo, skipped)
    todo = [c for c in todo if c.key in steps]
    costs: dict[Shape, list] = {shape: [] for shape in sorted({shape_of(c) for c in todo if c.name != DDP})}
    probes = {f"probe|V{v}|m{m}|{own}": _probe(b, (v, m, own), into) for (v, m, own), into in costs.items()}
    times = interleaved_rounds({**steps, **probes}, cfg.rounds, cfg.warmup, x.device, seed=cfg.seed)
    ours = [c for c in b.pipes if c.name == OURS]
    memory = {c.key: _memory(b, c) for c in ours}
    fastest = min(ours, key=lambda c: statistics.median(times[c.key]), default=None)  # same on all ranks
    trace = _trace(b, fastest) if fastest else None
    dist.barrier()
    return {"cases": [asdict(c) for c in todo], "skipped": skipped, "ranks": info.world_size,
            "times": {c.key: times[c.key] for c in todo}, "balances": b.balances, "memory": memory,
            "cut_search": searches,
            "costs": {m: got[-cfg.rounds:] for m, got in costs.items()},  # the warm-up probed too
            "trace": trace, "freed_memory_kept": malloc.keep_freed_memory(), "plan_costs": b.plan_costs}
