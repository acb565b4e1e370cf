"""`brigade check`: prove a pipeline computes what a single device computes.

Every rank builds the same model from the same seed, keeps a deep copy as the
single-device reference, and runs one batch both ways. It compares the loss,
every parameter's gradient, and every parameter and buffer after one SGD step.

BatchNorm: with m > 1 micro-batches each micro-batch is normalised with its own
statistics (as in gradient accumulation), so for models with BatchNorm the
reference runs the same micro-batches one after another on one device. With
m = 1 the reference is the plain full batch for every model.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from brigade import agent, groups
from brigade.errors import BrigadeError
from brigade.models import ModelSpec, load_model
from brigade.pipeline import microbatch
from brigade.pipeline.partition import check_chain, choose_balance, split
from brigade.pipeline.pipe import LocalPipeline, Pipeline
from brigade.pipeline.schedule import build
from brigade.rendezvous import LaunchSpec


@dataclass
class CheckConfig:
    model: str = "gpt"
    stages: int = 2
    schedule: str = "1f1b"
    microbatches: int = 4
    runtime: str = "process"  # process | local
    batch_size: int = 8
    balance: list[int] | None = None
    seed: int = 0
    atol: float = 1e-5
    model_options: dict = field(default_factory=dict)
    balance_by: str = "params"  # params | time, when balance is None
    devices: list[str] | None = None  # local runtime: one per stage; default one GPU each, else CPU


@dataclass
class CheckResult:
    schedule: str
    microbatches: int
    stages: int
    runtime: str
    balance: list[int]
    loss: float
    max_abs_loss_diff: float
    max_abs_grad_diff: float
    max_abs_param_diff: float
    reference: str
    ok: bool

    def to_dict(self) -> dict:
        return asdict(self)


def local_devices(n: int) -> list[str]:
    """One GPU per stage when there are enough, else every stage on the CPU."""
    return [f"cuda:{i}" for i in range(n)] if torch.cuda.device_count() >= n else ["cpu"] * n


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


def _has_batchnorm(blocks: list[nn.Module]) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for b in blocks for m in b.modules())


def _reference(spec: ModelSpec, x, y, m: int, lr: float):
    """Single device: loss, gradients and post-SGD state of a deep copy."""
    model = nn.Sequential(*copy.deepcopy(spec.blocks))
    per_mb = m > 1 and _has_batchnorm(spec.blocks)
    if per_mb:
        total = 0.0
        for xs, ys, w in zip(microbatch.split(x, m), microbatch.split(y, m),
                             microbatch.weights(x.shape[0], m)):
            loss = spec.loss_fn(model(xs), ys) * w
            loss.backward()
            total += loss.detach()
        loss = total
    else:
        loss = spec.loss_fn(model(x), y)
        loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    torch.optim.SGD(model.parameters(), lr=lr).step()
    state = [t.detach().clone() for t in model.state_dict().values()]
    return float(loss.detach()), grads, state, ("micro-batched (BatchNorm)" if per_mb else "full batch")


def _block_slices(balance: list[int], stage_modules: list[nn.Module]):
    """Index ranges of each stage's parameters and state entries in the full model's order."""
    p0 = s0 = 0
    out = []
    for mod in stage_modules:
        np_, ns = len(list(mod.parameters())), len(mod.state_dict())
        out.append((slice(p0, p0 + np_), slice(s0, s0 + ns)))
        p0, s0 = p0 + np_, s0 + ns
    return out


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    diffs = [(x.float() - y.float().to(x.device)).abs().max().item() for x, y in zip(a, b) if x.numel()]
    return max(diffs, default=0.0)


def run_case(cfg: CheckConfig, schedule: str, m: int, rank: int | None, lr: float = 0.1) -> CheckResult:
    """One (schedule, m) comparison. `rank` is this process's stage, or None for the local runtime."""
    spec = load_model(cfg.model, seed=cfg.seed, **cfg.model_options)
    x, y = spec.make_batch(cfg.batch_size, torch.Generator().manual_seed(cfg.seed + 1))
    microbatch.check(cfg.batch_size, m)
    build(schedule, cfg.stages, m)
    ref_loss, ref_grads, ref_state, ref_kind = _reference(spec, x, y, m, lr)
    balance = choose_balance(spec.blocks, cfg.stages, by=cfg.balance_by, sample=x[:2],
                             balance=cfg.balance)
    device = groups.init().device if rank is not None else torch.device("cpu")
    if rank is not None and dist.is_initialized():  # measured balances may differ between ranks
        agreed = torch.tensor(balance, device=device)  # NCCL takes only tensors on the group's GPU
        dist.broadcast(agreed, 0)
        balance = agreed.tolist()
    stages = split(spec.blocks, balance)
    slices = _block_slices(balance, stages)
    mine = range(cfg.stages) if rank is None else [rank]
    if rank is None:
        devices = cfg.devices or local_devices(cfg.stages)
        with LocalPipeline(stages, devices, schedule, m, spec.loss_fn) as pipe:
            loss = float(pipe.step(x, y))
    else:
        stages[rank].to(device)
        loss = float(Pipeline(stages[rank], schedule, m, spec.loss_fn, device=device).step(x, y))
    grads, state, ref_g, ref_s = [], [], [], []
    for s in mine:
        grads += [p.grad for p in stages[s].parameters()]
        ref_g += ref_grads[slices[s][0]]
    grad_diff = _max_diff(grads, ref_g)
    for s in mine:
        torch.optim.SGD(stages[s].parameters(), lr=lr).step()
        state += [t.detach() for t in stages[s].state_dict().values()]
        ref_s += ref_state[slices[s][1]]
    diffs = torch.tensor([abs(loss - ref_loss), grad_diff, _max_diff(state, ref_s)], dtype=torch.float64,
                         device=device)
    if rank is not None and dist.get_world_size() > 1:
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    d = diffs.tolist()
    return CheckResult(schedule, m, cfg.stages, cfg.runtime, balance, loss, d[0], d[1], d[2], ref_kind,
                       ok=max(d) <= cfg.atol)


@contextlib.contextmanager
def exact_matmuls():
    """fp32 matmuls and convolutions in full precision while comparing.

    cuBLAS and cuDNN may use TF32 for fp32 work (10-bit mantissas); against the fp32
    reference that is a mismatch of about 1e-3, not a pipeline bug.
    """
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def worker(cfg: CheckConfig, cases: list[tuple[str, int]]) -> list[dict]:
    """Process entry point: run every case in one process group (one start for many cases)."""
    info = groups.init(threads=1)
    try:
        with exact_matmuls():
            return [run_case(cfg, s, m, info.rank).to_dict() for s, m in cases]
    finally:
        groups.destroy()


def preflight(cfg: CheckConfig, cases: list[tuple[str, int]]) -> None:
    """Catch bad input in this process, before any worker starts.

    Raises:
        BrigadeError: unknown runtime/model/schedule, bad sizes or balance, blocks that do not chain.
    """
    if cfg.runtime not in ("process", "local"):
        raise BrigadeError(f"unknown runtime {cfg.runtime!r}: expected process or local")
    if cfg.devices is not None:
        if cfg.runtime != "local":
            raise BrigadeError("--devices places the stages of --runtime local: add --runtime local")
        _check_devices(cfg.devices, cfg.stages)
    if cfg.batch_size < 1:
        raise BrigadeError(f"batch size {cfg.batch_size}: need at least 1")
    spec = load_model(cfg.model, seed=cfg.seed, **cfg.model_options)
    if cfg.balance_by not in ("params", "time"):
        raise BrigadeError(f"unknown balance method {cfg.balance_by!r}: expected params or time")
    choose_balance(spec.blocks, cfg.stages, balance=cfg.balance)
    for schedule, m in cases:
        build(schedule, cfg.stages, m)
        microbatch.check(cfg.batch_size, m)
    x, _ = spec.make_batch(min(cfg.batch_size, 2), torch.Generator().manual_seed(0))
    check_chain(spec.blocks, x)


def run_check(cfg: CheckConfig, cases: list[tuple[str, int]] | None = None,
              port: int | None = None) -> list[dict]:
    """Run the comparison for each (schedule, m) in `cases` (default: the config's own)."""
    cases = cases or [(cfg.schedule, cfg.microbatches)]
    preflight(cfg, cases)
    if cfg.runtime == "local":
        with exact_matmuls():
            return [run_case(cfg, s, m, None).to_dict() for s, m in cases]
    results = agent.launch(worker, LaunchSpec(cfg.stages, port=port), cfg, cases)
    return results[0]
