"""`brigade check`'s refusals, in the calling process before any worker starts: every bad size,
layout, device list, schedule or balance is one line (`BrigadeError`)."""

from __future__ import annotations

import os

import torch

from brigade.check.config import Case, CheckConfig, adapters_of, case_of, model_options
from brigade.check.reference import has_batchnorm
from brigade.config.precision import check_float8
from brigade.config.validate import chunked_loss
from brigade.errors import BrigadeError
from brigade.models import ModelSpec, load_model
from brigade.parallel import lora, recompute, tensor
from brigade.pipeline.batches import microbatch
from brigade.pipeline.plans.schedule import build, placement
from brigade.pipeline.stages import structure
from brigade.pipeline.stages.partition import check_chain, choose_balance
from brigade.world.degrees import Degrees


def local_devices(n: int) -> list[str]:
    """One GPU per stage when there are enough, else every stage on the CPU."""
    return [f"cuda:{i}" for i in range(n)] if torch.cuda.device_count() >= n else ["cpu"] * n


def max_workers(runtime: str = "process") -> int:
    """How many stage workers (processes or device threads) this machine should run at once.

    A process per GPU; on CPU four per core (at least 8), so 2 stages × 2 replicas × tp 2 of a
    tiny model fit anywhere (a check computes one batch: slow, not wrong, when oversubscribed).
    """
    if runtime == "process" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(8, 4 * (os.cpu_count() or 1))


def _check_devices(devices: list[str], stages: int) -> None:
    if len(devices) != stages:
        raise BrigadeError(f"--devices {','.join(devices)} names {len(devices)} devices for {stages} "
                           "stages: give one per stage, like cpu,cuda:0")
    for d in devices:
        try:
            dev = torch.device(d)
        except RuntimeError:
            raise BrigadeError(f"--devices: {d!r} is not a device: use cpu or cuda:N") from None
        if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
            raise BrigadeError(f"--devices: {d} is not visible ({torch.cuda.device_count()} GPUs here): "
                               "use cpu or a GPU this machine has")


def _check_layout(cfg: CheckConfig, spec: ModelSpec) -> None:
    """dp, the workers it starts, and what dp cannot check."""
    # each ≥ 1, --shard and --ep dividing --dp
    Degrees(dp=cfg.dp, shard=cfg.shard, cp=cfg.cp, tp=cfg.tp, ep=cfg.ep).check()
    _check_experts(cfg, spec)
    _check_context(cfg, spec)
    workers, cap = cfg.dp * cfg.stages * cfg.cp * cfg.tp, max_workers(cfg.runtime)
    if workers > cap and (cfg.runtime == "process" or cfg.dp > 1):
        tp = (f" × --cp {cfg.cp}" if cfg.cp > 1 else "") + (f" × --tp {cfg.tp}" if cfg.tp > 1 else "")
        raise BrigadeError(f"--dp {cfg.dp} × --stages {cfg.stages}{tp} = {workers} workers but this machine "
                           f"should run at most {cap} (one per GPU, four per CPU core): use fewer of either")
    _check_tensor_parallel(cfg, spec)
    if cfg.shard > 1 and cfg.runtime == "local":
        raise BrigadeError(f"--shard {cfg.shard} with --runtime local: FSDP2 shards over one device per "
                           "process, and the local runtime drives every stage from one; use "
                           "--runtime process")
    if cfg.batch_size % cfg.dp:
        raise BrigadeError(f"--batch-size {cfg.batch_size} does not split into --dp {cfg.dp} equal "
                           f"replica batches: use a multiple of {cfg.dp}")
    if cfg.dp > 1 and cfg.devices is not None:
        raise BrigadeError(f"--devices with --dp {cfg.dp}: each replica takes its own devices; "
                           "drop --devices")
    if cfg.dp > 1 and has_batchnorm(spec.blocks):
        raise BrigadeError(f"{cfg.model} has BatchNorm, whose running statistics DDP takes from replica 0 "
                           "(no single device computes them): check it with --dp 1")


def _check_documents(cfg: CheckConfig) -> None:
    """--documents: on a model whose blocks take packed documents, without --cp."""
    if not cfg.documents:
        return
    if cfg.model != "gpt" and not cfg.model.startswith("hf:"):
        raise BrigadeError(f"--documents with {cfg.model}: only the gpt and hf:DIR models take packed "
                           "documents; drop --documents")
    from brigade.config.context import refuse_documents

    refuse_documents(cfg.cp, "drop --documents", what="--documents")


def _check_experts(cfg: CheckConfig, spec: ModelSpec) -> None:
    """--ep: across processes, over a model whose every MoE layer's experts it divides."""
    if cfg.ep == 1:
        return
    from brigade.parallel.experts import check_model

    if cfg.runtime == "local":
        raise BrigadeError(f"--ep {cfg.ep} with --runtime local: expert parallel splits experts over "
                           "processes, and the local runtime drives every stage from one; use "
                           "--runtime process")
    check_model(spec.blocks, cfg.ep, cfg.model)


def _check_context(cfg: CheckConfig, spec: ModelSpec) -> None:
    """--cp: across processes, without --ep, on a batch whose sequences it splits, over heads that
    all-to-all splits (where the blocks' plans say how many), and the method this device has."""
    from brigade.parallel import context

    context.check_layout(cfg.cp, cfg.cp_method, ep=cfg.ep, runtime=cfg.runtime)
    if cfg.cp == 1:
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    method = context.method_for(cfg.cp_method, device)
    x, _ = spec.make_batch(1, torch.Generator().manual_seed(0))
    lengths = [t.shape[1] for t in structure.flatten(x, "input")[0]
               if torch.is_tensor(t) and t.dim() == 2 and not t.is_floating_point()]
    if not lengths:
        raise BrigadeError(f"--cp {cfg.cp} on {cfg.model}, whose inputs hold no token sequence (no (B, T) "
                           "integer tensor): context parallel splits sequences; drop --cp")
    context.check_length(lengths[0], cfg.cp, cfg.tp if cfg.sequence_parallel else 1, method,
                         what=f"{cfg.model}'s sequence length")
    context.check_model(spec.blocks, cfg.cp, method, cfg.tp, lengths[0], cfg.model)


def _check_tensor_parallel(cfg: CheckConfig, spec: ModelSpec) -> None:
    """--tp: across processes, and a plan for every block that `tp` divides."""
    if cfg.tp > 1 and cfg.runtime == "local":
        raise BrigadeError(f"--tp {cfg.tp} with --runtime local: tensor parallel splits each block over "
                           "processes of a DeviceMesh, and the local runtime drives every stage from one "
                           "process; use --runtime process")
    tensor.check_plans(spec.blocks, cfg.tp, cfg.model)


def _check_microbatches(cfg: CheckConfig, m: int) -> None:
    replica = cfg.batch_size // cfg.dp
    if cfg.dp > 1 and m > replica:
        raise BrigadeError(f"microbatches={m} is more than a replica's batch ({replica} = --batch-size "
                           f"{cfg.batch_size} / --dp {cfg.dp}): use at most {replica} or a larger batch")
    microbatch.check(cfg.batch_size, m)


def preflight(cfg: CheckConfig, cases: list[Case]) -> None:
    """Catch bad input in this process, before any worker starts.

    Raises:
        BrigadeError: unknown runtime/model/schedule, a V the schedule cannot run, bad sizes,
            dp or balance, more workers than the machine should run, blocks that do not chain.
    """
    if cfg.runtime not in ("process", "local"):
        raise BrigadeError(f"unknown runtime {cfg.runtime!r}: expected process or local")
    if cfg.devices is not None:
        if cfg.runtime != "local":
            raise BrigadeError("--devices places the stages of --runtime local: add --runtime local")
        _check_devices(cfg.devices, cfg.stages)
    if cfg.batch_size < 1:
        raise BrigadeError(f"batch size {cfg.batch_size}: need at least 1")
    if cfg.loss_chunk < 1:
        raise BrigadeError(f"--loss-chunk {cfg.loss_chunk}: must be ≥ 1 positions")
    chunked_loss(cfg.chunked_loss)
    if cfg.float8:
        check_float8(cfg.float8)
    _check_documents(cfg)
    spec = load_model(cfg.model, seed=cfg.seed, **model_options(cfg))
    if cfg.balance_by not in ("params", "time"):
        raise BrigadeError(f"unknown balance method {cfg.balance_by!r}: expected params or time")
    _check_layout(cfg, spec)
    if cfg.lora:
        lora.check_with(cfg.float8)
        lora.targets(spec.blocks, adapters_of(cfg))
    for case in cases:
        schedule, m, virtual, mode = case_of(cfg, case)
        recompute.modes(spec.blocks, mode)
        build(schedule, cfg.stages, m, virtual)
        _check_microbatches(cfg, m)
        choose_balance(spec.blocks, cfg.stages * placement(schedule, cfg.stages, virtual)[0],
                       balance=cfg.balance)
    x, _ = spec.make_batch(min(cfg.batch_size, 2), torch.Generator().manual_seed(0))
    check_chain(spec.blocks, x)
