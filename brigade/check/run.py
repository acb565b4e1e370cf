"""`brigade check`: prove a pipeline computes what a single device computes.

Every rank builds the same model from the same seed, keeps a deep copy as the
single-device reference, and runs one batch both ways. It compares the loss,
every parameter's gradient, and every parameter and buffer after one SGD step.

A case is (schedule, m, V, recompute): the model is cut into stages × V pieces, V per rank as
the schedule places them, its blocks recomputed or not. With dp replicas each runs its slice of
the batch and every stage module is DDP-wrapped over its replicas, or with --shard sharded over
them (FSDP2, `parallel.shard`); the reference is still one device on the whole batch (the
replicas' mean loss and averaged gradients must equal it). What a check is asked is config.py's;
its refusals, before any worker starts, preflight.py's.

    process runtime   dp × stages processes over a DeviceMesh (dp, pp), × tp with --tp: each
                      stage's blocks split over tp processes (parallel.tensor), gradients
                      gathered from their DTensor shards to be compared
    local runtime     one process (dp = 1) or dp processes, each a LocalPipeline whose
                      device i DDPs with device i of the other processes

BatchNorm: with m > 1 each micro-batch is normalised with its own statistics (as in
gradient accumulation), so the reference runs the same micro-batches one after another;
with m = 1 it is the plain full batch. BatchNorm under dp is refused: DDP broadcasts
replica 0's running statistics, which no single device computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from brigade.check.config import Case, CheckConfig, CheckResult, case_of
from brigade.check.inputs import sample
from brigade.check.preflight import local_devices, preflight
from brigade.check.reference import exact_matmuls, reference
from brigade.config import ParallelConfig
from brigade.dtensors import full
from brigade.launch import agent, groups
from brigade.launch.rendezvous import LaunchSpec
from brigade.models import ModelSpec, load_model
from brigade.parallel import recompute, tensor
from brigade.parallel.shard import shard_stage
from brigade.pipeline.batches import microbatch
from brigade.pipeline.pipe import LocalPipeline, Pipeline
from brigade.pipeline.plans.schedule import placement, stages_on
from brigade.pipeline.stages.partition import choose_balance, split
from brigade.pipeline.stages.ties import TieGroups, find_shared, sum_tied_grads, untie
from brigade.train.layout import make_layout
from brigade.train.replicas import data_parallel, stage_group


@dataclass
class Where:
    """This process's place: its pipeline rank (None: the local runtime drives every rank)."""

    pp_rank: int | None = None
    dp: int = 1
    dp_rank: int = 0
    pp_group: object = None
    dp_group: object = None  # None: the whole world (local runtime)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    devices: list | None = None  # local runtime: one per rank
    stage_groups: list | None = None  # local runtime under dp: one group per device
    shard_mesh: object = None  # --shard (or dp under --tp): fully_shard's mesh (make_layout's)
    tp: int = 1
    tp_mesh: object = None  # --tp: parallelize_module's mesh (make_layout's)


def _untie(blocks: list[nn.Module], balance: list[int], ranks: list[int], where: Where):
    """Give each stage its own copy of a parameter shared across stages (a tied embedding and
    head); returns (ties, their process groups or None) for `ties.sum_tied_grads`."""
    stage = [s for s, n in enumerate(balance) for _ in range(n)]
    ties = [t for t in find_shared(blocks) if len({stage[b] for b in t.blocks}) > 1]
    untie(blocks, ties)
    if not ties or where.pp_rank is None:
        return ties, None  # local runtime: every copy is in this process
    pp = len(set(ranks))  # global rank = (dp row · pp + pp rank) · tp + tp rank (make_layout)
    return ties, TieGroups(ties, [{b: (row * pp + ranks[stage[b]]) * where.tp + t for b in range(len(blocks))}
                                  for row in range(where.dp) for t in range(where.tp)])


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    a = [full(x) for x in a]  # a sharded parameter or gradient: gathered (every rank takes part)
    diffs = [(x.float() - y.float().to(x.device)).abs().max().item() for x, y in zip(a, b) if x.numel()]
    return max(diffs, default=0.0)


def _replica(t, where: Where):
    return microbatch.split_structure(t, where.dp)[where.dp_rank]


def _step(cfg: CheckConfig, spec: ModelSpec, stages: list[nn.Module], schedule: str, m: int, v: int,
          x, y, where: Where) -> tuple[float, list[int]]:
    """This replica's pipeline step on its slice: (replica loss, the stages held here)."""
    x, y = _replica(x, where), _replica(y, where)
    if where.pp_rank is None:
        devices = _local_devices(cfg, where)
        ranks = placement(schedule, cfg.stages, v)[1]

        def wrap(s: int, module: nn.Module) -> nn.Module:
            if where.stage_groups is None:
                return module
            device = torch.device(devices[ranks[s]])
            return data_parallel(module, where.stage_groups[ranks[s]],
                                 [device] if device.type == "cuda" else None)

        with LocalPipeline(stages, devices, schedule, m, spec.loss_fn, wrap=wrap, virtual=v) as pipe:
            return float(pipe.step(x, y)), list(range(len(stages)))
    mine = stages_on(schedule, cfg.stages, where.pp_rank, v)
    ids = [where.device] if where.device.type == "cuda" else None
    modules = {s: stages[s].to(where.device) for s in mine}
    if where.tp > 1:  # tensor parallel first, then the data-parallel wrapper (torchtitan's order)
        tensor.parallelize([b for s in mine for b in modules[s].children()], where.tp_mesh)
    if where.shard_mesh is not None:
        modules = {s: shard_stage(mod, where.shard_mesh, cfg.reshard) for s, mod in modules.items()}
    elif where.dp > 1:
        modules = {s: data_parallel(mod, where.dp_group, ids) for s, mod in modules.items()}
    pipe = Pipeline(modules, schedule, m, spec.loss_fn, group=where.pp_group, device=where.device,
                    virtual=v)
    return float(pipe.step(x, y)), mine


def _local_devices(cfg: CheckConfig, where: Where) -> list:
    """The local runtime's device per rank."""
    return where.devices or cfg.devices or local_devices(cfg.stages)


def _reference_device(cfg: CheckConfig, where: Where) -> torch.device:
    """Where the one-device reference runs: on the pipeline's device when all its stages share one,
    so that both run the same kernels (a GPU's fp32 rounds otherwise than the CPU's, and a model
    like ResNet-50 with BatchNorm over a micro-batch of 2 magnifies that far past 1e-5); else on
    the CPU."""
    if where.pp_rank is not None:
        return where.device
    devices = {torch.device(d) for d in _local_devices(cfg, where)}
    return devices.pop() if len(devices) == 1 else torch.device("cpu")


def run_case(cfg: CheckConfig, case: Case, where: Where | None = None, lr: float = 0.1) -> CheckResult:
    """One (schedule, m, V) comparison from this process's place (default: local, dp = 1)."""
    where = where or Where()
    schedule, m, virtual, mode = case_of(cfg, case)
    v = placement(schedule, cfg.stages, virtual)[0]
    spec = load_model(cfg.model, seed=cfg.seed, **cfg.model_options)
    x, y = spec.make_batch(cfg.batch_size, torch.Generator().manual_seed(cfg.seed + 1))
    ref_device = _reference_device(cfg, where)
    ref_loss, ref_grads, ref_state, ref_kind = reference(spec, x, y, m, lr, ref_device)
    balance = choose_balance(spec.blocks, cfg.stages * v, by=cfg.balance_by, sample=sample(x),
                             balance=cfg.balance)
    if dist.is_initialized():  # measured balances may differ between processes
        agreed = torch.tensor(balance, device=where.device)  # NCCL takes only tensors on its GPU
        dist.broadcast(agreed, 0)
        balance = agreed.tolist()
    ties, tie_groups = _untie(spec.blocks, balance, placement(schedule, cfg.stages, v)[1], where)
    recompute.apply(spec.blocks, mode)  # the reference (a deep copy) ran without
    stages = split(spec.blocks, balance)
    loss, mine = _step(cfg, spec, stages, schedule, m, v, x, y, where)
    held = {b: spec.blocks[b] for s in mine for b in range(sum(balance[:s]), sum(balance[:s + 1]))}
    sum_tied_grads(ties, held, tie_groups)
    if where.dp > 1:  # the replicas' mean loss is the whole batch's
        total = torch.tensor(loss, dtype=torch.float64, device=where.device)
        dist.all_reduce(total, group=where.dp_group)
        loss = float(total) / where.dp
    grad_diff = _max_diff([p.grad for b in held.values() for p in b.parameters()],
                          [g for b in held for g in ref_grads[b]])
    for s in mine:
        torch.optim.SGD(stages[s].parameters(), lr=lr).step()
    param_diff = _max_diff([t.detach() for b in held.values() for t in b.state_dict().values()],
                           [t for b in held for t in ref_state[b]])
    diffs = torch.tensor([abs(loss - ref_loss), grad_diff, param_diff], dtype=torch.float64,
                         device=where.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    d = diffs.tolist()
    return CheckResult(schedule, m, cfg.stages, cfg.runtime, balance, loss, d[0], d[1], d[2], ref_kind,
                       ok=max(d) <= cfg.atol, virtual=v, dp=cfg.dp, reference_device=str(ref_device),
                       shard=cfg.shard, recompute=mode, tp=cfg.tp)


def _where(cfg: CheckConfig, info: groups.DistInfo) -> Where:
    """This worker's place: a DeviceMesh (dp, pp) cell, or one replica of a local pipeline."""
    if cfg.runtime == "process":
        lay = make_layout(ParallelConfig(dp=cfg.dp, pp=cfg.stages, shard=cfg.shard, tp=cfg.tp), info.device)
        return Where(lay.pp_rank, lay.dp, lay.dp_rank, lay.pp_group, lay.dp_group, lay.device,
                     shard_mesh=lay.shard_mesh, tp=lay.tp, tp_mesh=lay.tp_mesh)
    devices = groups.local_devices(info.device.type, info.local_rank, cfg.stages)
    # One group per device: each device's thread issues its own all-reduces.
    return Where(None, cfg.dp, info.rank, None, None, devices[0], devices,
                 [stage_group(d) for d in devices])


def worker(cfg: CheckConfig, cases: list[Case]) -> list[dict]:
    """Process entry point: run every case in one process group (one start for many cases)."""
    info = groups.init(threads=1, local_stages=cfg.stages if cfg.runtime == "local" else 1)
    where = _where(cfg, info)
    with exact_matmuls():
        results = [run_case(cfg, c, where).to_dict() for c in cases]
    del where  # its stage groups' last references go inside destroy, after the drain
    groups.destroy()  # a failure leaves it to agent's worker wrapper, with no drain
    return results


def run_check(cfg: CheckConfig, cases: list[Case] | None = None, port: int | None = None) -> list[dict]:
    """Run the comparison for each (schedule, m[, virtual]) in `cases` (default: the config's own).

    Returns:
        One result dict per case, in order (rank 0's; diffs are the maximum over all processes).

    Raises:
        BrigadeError: as `preflight`, before any process starts.
    """
    cases = cases or [(cfg.schedule, cfg.microbatches, cfg.virtual)]
    preflight(cfg, cases)
    if cfg.runtime == "local" and cfg.dp == 1:
        with exact_matmuls():
            return [run_case(cfg, c).to_dict() for c in cases]
    nproc = cfg.dp * (cfg.stages * cfg.tp if cfg.runtime == "process" else 1)
    results = agent.launch(worker, LaunchSpec(nproc, port=port), cfg, cases)
    return results[0]
