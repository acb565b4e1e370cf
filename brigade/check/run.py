"""`brigade check`: prove a pipeline computes what a single device computes.

Every rank builds the same model from the same seed, keeps a deep copy as the
single-device reference, and runs one batch both ways. It compares the loss,
every parameter's gradient, and every parameter and buffer after one SGD step.

A case is (schedule, m, V, recompute): the model is cut into stages × V pieces, V per rank as
the schedule places them, and this process's stages are built by the same assembler as
`brigade train`'s (`parallel.assemble`): tensor parallel, recompute, then DDP or FSDP2 over the
replicas, in that one order. With dp replicas each runs its slice of the batch; the reference is
still one device on the whole batch (the replicas' mean loss and averaged gradients must equal
it). What a check is asked is config.py's; its refusals, before any worker starts, preflight.py's.

    process runtime   dp × stages (× tp) processes, one cell each of the world's DeviceMesh
                      (`world.World`); with --tp each stage's blocks split over tp processes,
                      gradients gathered from their DTensor shards to be compared
    local runtime     one process (dp = 1) or dp processes, each a LocalPipeline whose
                      stage i DDPs with stage i of the other processes

BatchNorm: with m > 1 each micro-batch is normalised with its own statistics (as in
gradient accumulation), so the reference runs the same micro-batches one after another;
with m = 1 it is the plain full batch. BatchNorm under dp is refused: DDP broadcasts
replica 0's running statistics, which no single device computes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from brigade.check.config import Case, CheckConfig, CheckResult, adapters_of, case_of, model_options
from brigade.check.inputs import sample
from brigade.check.preflight import local_devices, preflight
from brigade.check.reference import exact_matmuls, reference
from brigade.config import ParallelConfig, degrees_of
from brigade.dtensors import full
from brigade.errors import RunError
from brigade.launcher import agent, groups
from brigade.launcher.rendezvous import LaunchSpec
from brigade.models import ModelSpec, load_model, moe
from brigade.parallel.assemble import Assembly, Cut, assemble
from brigade.pipeline.batches import microbatch
from brigade.pipeline.plans.schedule import placement
from brigade.pipeline.stages.partition import choose_balance
from brigade.world.degrees import Degrees
from brigade.world.mesh import World


def _max_diff(a: list[torch.Tensor | None], b: list[torch.Tensor]) -> float:
    """The largest absolute difference between the pipeline's tensors `a` and the reference's `b`.

    The reference gives every parameter a gradient; a pipeline's gradient left None (one that no
    reduction ever wrote, as when FSDP reduce-scatters before a split backward's weight pass) is
    a failure of the check, infinitely far off, not a crash of it.
    """
    if any(x is None for x, _ in zip(a, b)):
        return float("inf")
    a = [full(x) for x in a]  # a sharded parameter or gradient: gathered (every rank takes part)
    diffs = [(x.float() - y.float().to(x.device)).abs().max().item() for x, y in zip(a, b) if x.numel()]
    return max(diffs, default=0.0)


def _replica(t, world: World):
    return microbatch.split_structure(t, world.degrees.dp)[world.coords.dp]


def _local_devices(cfg: CheckConfig) -> list[str]:
    """The local runtime's device per rank, in the calling process (dp = 1)."""
    return cfg.devices or local_devices(cfg.stages)


def _reference_device(world: World) -> torch.device:
    """Where the one-device reference runs: on the pipeline's device when all its stages share one,
    so that both run the same kernels (a GPU's fp32 rounds otherwise than the CPU's, and a model
    like ResNet-50 with BatchNorm over a micro-batch of 2 magnifies that far past 1e-5); else on
    the CPU."""
    devices = set(world.devices)
    return devices.pop() if len(devices) == 1 else torch.device("cpu")


def _cut(cfg: CheckConfig, spec: ModelSpec, schedule: str, v: int, x, device: torch.device) -> Cut:
    """The model cut as the case asks (by parameters or measured time), agreed by every process
    (measured balances may differ between them)."""
    balance = choose_balance(spec.blocks, cfg.stages * v, by=cfg.balance_by, sample=sample(x),
                             balance=cfg.balance)
    if dist.is_initialized():
        agreed = torch.tensor(balance, device=device)  # NCCL takes only tensors on its GPU
        dist.broadcast(agreed, 0)
        balance = agreed.tolist()
    return Cut(tuple(balance), tuple(placement(schedule, cfg.stages, v)[1]))


def run_case(cfg: CheckConfig, case: Case, world: World | None = None, lr: float = 0.1) -> CheckResult:
    """One (schedule, m, V) comparison from this process's place (default: the local runtime in
    this process, dp = 1)."""
    world = world or World(Degrees(), torch.device(_local_devices(cfg)[0]), _local_devices(cfg))
    schedule, m, virtual, mode = case_of(cfg, case)
    v = placement(schedule, cfg.stages, virtual)[0]
    spec = load_model(cfg.model, seed=cfg.seed, **model_options(cfg))
    x, y = spec.make_batch(cfg.batch_size, torch.Generator().manual_seed(cfg.seed + 1))
    ref_device = _reference_device(world)
    # float8's reference cuts the batch as the replicas and their micro-batches do
    adapters = adapters_of(cfg)
    ref_loss, ref_grads, ref_state, ref_kind = reference(spec, x, y, m, lr, ref_device, cfg.float8,
                                                         cfg.dp if cfg.float8 else 1, adapters)
    cut = _cut(cfg, spec, schedule, v, x, world.device)
    # the same assembler as brigade train's (the reference, a deep copy, ran unwrapped)
    built = assemble(spec.blocks, cut, world, mode, cfg.reshard, sequence_parallel=cfg.sequence_parallel,
                     compile=cfg.compile, float8=cfg.float8, cp_method=cfg.cp_method,
                     chunked_loss=cfg.chunked_loss, loss_chunk=cfg.loss_chunk, adapters=adapters)
    loss = _step(built, schedule, m, spec.loss_fn, x, y, warm=cfg.compile)
    _compiled_somewhere(cfg, built)
    held = built.held
    grad_diff = _max_diff([p.grad for b in held.values() for p in b.parameters() if p.requires_grad],
                          [g for b in held for g in ref_grads[b]])
    torch.optim.SGD(built.owned.parameters(), lr=lr).step()
    param_diff = _max_diff([t.detach() for b in held.values() for t in b.state_dict().values()],
                           [t for b in held for t in ref_state[b]])
    chunks = built.chunked.last if built.chunked is not None and built.chunked.on else 0
    diffs = torch.tensor([abs(loss - ref_loss), grad_diff, param_diff, chunks], dtype=torch.float64,
                         device=world.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    d = diffs.tolist()
    return CheckResult(schedule, m, cfg.stages, cfg.runtime, list(cut.balance), loss, d[0], d[1], d[2],
                       ref_kind, ok=max(d[:3]) <= cfg.atol, virtual=v, dp=cfg.dp,
                       reference_device=str(ref_device), shard=cfg.shard, recompute=mode, tp=cfg.tp,
                       sequence_parallel=cfg.tp > 1 and cfg.sequence_parallel, ep=cfg.ep, cp=cfg.cp,
                       cp_method=built.context.method if built.context else "", lora=cfg.lora,
                       loss_chunks=int(d[3]))


def _step(built: Assembly, schedule: str, m: int, loss_fn, x, y, warm: bool = False) -> float:
    """One pipeline step of this replica on its slice, its shared weights' gradients summed; the
    replicas' mean loss (the whole batch's). `warm`: a step first, its gradients dropped: a
    pipeline watches its stages' first forwards for random draws (`runtime.randomness`) under a
    dispatch mode, which compiled graphs cannot run under, so under --compile the compared step
    is the second, where they run compiled."""
    world = built.world
    pipe = built.pipeline(schedule, m, loss_fn)
    moe.per_step(built.held.values(), microbatch.batch_size_of(_replica(x, world)))  # balancing's share
    try:
        if warm:
            pipe.step(_replica(x, world), _replica(y, world))
            for p in built.owned.parameters():
                p.grad = None
        loss = float(pipe.step(_replica(x, world), _replica(y, world)))
    finally:
        if world.local:
            pipe.close()
    built.settle_grads()
    if world.degrees.dp > 1:
        total = torch.tensor(loss, dtype=torch.float64, device=world.device)
        dist.all_reduce(total, group=world.group("dp"))
        loss = float(total) / world.degrees.dp
    return loss


def _compiled_somewhere(cfg: CheckConfig, built: Assembly) -> None:
    """Under --compile, refuse a check in which this process compiled nothing though it holds
    blocks that should be: it would compare eager with eager and pass for nothing.

    Raises:
        RunError: no compiled graph here.
    """
    if not cfg.compile or all(i in built.eager for i in built.held):
        return
    from torch._dynamo.utils import counters

    if not counters["stats"]["unique_graphs"]:
        raise RunError(f"--compile: no block compiled on this process (blocks {sorted(built.held)}); "
                       "torch.compile fell back to eager: run with TORCH_LOGS=dynamo to see why")


def _degrees(cfg: CheckConfig) -> Degrees:
    """The check's world: dp × stages × tp processes, or dp processes of the local runtime (each
    drives every stage)."""
    if cfg.runtime == "process":
        return degrees_of(ParallelConfig(dp=cfg.dp, pp=cfg.stages, shard=cfg.shard, tp=cfg.tp, ep=cfg.ep,
                                         cp=cfg.cp))
    return Degrees(dp=cfg.dp)


def _world(cfg: CheckConfig, info: groups.DistInfo) -> World:
    """This worker's place: a cell of the DeviceMesh (dp, pp, tp), or one replica of a local pipeline."""
    if cfg.runtime == "process":
        return World(_degrees(cfg), info.device)
    devices = groups.local_devices(info.device.type, info.local_rank, cfg.stages)
    return World(_degrees(cfg), devices[0], devices)


def worker(cfg: CheckConfig, cases: list[Case]) -> list[dict]:
    """Process entry point: run every case in one process group (one start for many cases)."""
    info = groups.init(threads=1, local_stages=cfg.stages if cfg.runtime == "local" else 1)
    world = _world(cfg, info)
    with exact_matmuls():
        results = [run_case(cfg, c, world).to_dict() for c in cases]
    del world  # its groups' last references go inside destroy, after the drain
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
    results = agent.launch(worker, LaunchSpec(_degrees(cfg).size, port=port), cfg, cases)
    return results[0]
