"""Process groups and devices: the launcher's environment in, a joined group and a device out.

Inside a worker (started by brigade's launcher, torchrun or srun), `init()` reads the
environment the launcher set, picks the backend and this process's device(s) — one place
decides which GPU a local rank drives (`local_devices`) — and joins the process group.
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from brigade.errors import BrigadeError
from brigade.host import malloc
from brigade.host.net import free_port
from brigade.launcher import rendezvous
from brigade.launcher.env import launcher_env, slurm_env


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def pick_backend(requested: str | None = None) -> tuple[str, str]:
    """(backend, device type): NCCL on CUDA when GPUs exist, else gloo on CPU."""
    if requested in (None, "auto"):
        return ("nccl", "cuda") if torch.cuda.is_available() else ("gloo", "cpu")
    if requested == "nccl" and not torch.cuda.is_available():
        raise BrigadeError("backend nccl needs CUDA GPUs and none is visible: use --backend gloo")
    if requested not in ("nccl", "gloo"):
        raise BrigadeError(f"unknown backend {requested!r}: expected auto, gloo or nccl")
    return requested, ("cuda" if requested == "nccl" else "cpu")


def _prepare_env() -> None:
    """Under torchrun the variables are set; under Slurm translate them; alone, a world of one."""
    found = launcher_env()
    if found is not None and found.launcher == "torchrun":
        return
    if "SLURM_PROCID" in os.environ:
        os.environ.update(slurm_env(os.environ))
        return
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})


def local_devices(device_type: str, local_rank: int, n: int = 1,
                  count: int | None = None) -> list[torch.device]:
    """The `n` (--local-stages) devices this process drives, stage 0's first: the one place that decides.

    Local rank r drives cuda:r·n onwards when that many GPUs are visible (torchrun), else (r mod
    count/n)·n onwards (Slurm shows each task its own: cuda:0 at LOCAL_RANK 3). `count`: default
    `torch.cuda.device_count()`. Raises BrigadeError when fewer than `n` are visible.
    """
    if device_type != "cuda":
        return [torch.device(device_type)] * n
    count = torch.cuda.device_count() if count is None else count
    if count < n:
        raise BrigadeError(f"--local-stages {n} needs {n} GPUs per process but {count} are visible "
                           "(CUDA_VISIBLE_DEVICES): lower --local-stages or give each task more GPUs")
    first = local_rank * n if count >= (local_rank + 1) * n else (local_rank % (count // n)) * n
    return [torch.device("cuda", first + i) for i in range(n)]


def init(backend: str | None = None, threads: int | None = None,
         timeout_s: float | None = None, local_stages: int = 1) -> DistInfo:
    """Join the process group described by the environment (torchrun, Slurm, or none: alone).

    `timeout_s` bounds every collective and transfer: a stalled peer fails the run (and lets
    the elastic agent restart it) instead of hanging for the backend's default 30 minutes.
    The group is bound to the process's GPU (`local_devices`), unless it drives several
    (`local_stages` > 1): torch lets a new group bind only the default group's device, and
    the layout binds each stage's group to that stage's GPU.
    """
    backend, device_type = pick_backend(backend)
    _prepare_env()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if threads:
        torch.set_num_threads(threads)
    if device_type == "cpu":
        malloc.keep_freed_memory()
    device = local_devices(device_type, local_rank, local_stages)[0]
    if device_type == "cuda":
        torch.cuda.set_device(device)
    # Seen here: after an elastic restart, gloo's eager full-mesh connect sometimes dials the
    # previous attempt's address and times out. Connecting each pair on first use avoids it.
    os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device_type == "cuda" and local_stages == 1 else {}
        if timeout_s:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        store = rendezvous.loopback_store(kwargs.get("timeout", datetime.timedelta(minutes=30)))
        if store is not None:
            kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        _join(backend, device, kwargs)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def _join(backend: str, device: torch.device, kwargs: dict) -> None:
    """init_process_group, with NCCL's refusal of two ranks on one GPU said in one line."""
    try:
        dist.init_process_group(backend, **kwargs)
    except dist.DistBackendError as exc:
        if "Duplicate GPU" not in str(exc):
            raise
        raise BrigadeError(f"rank {os.environ.get('RANK', '?')} and another process both drive {device}, "
                           "but NCCL needs one GPU per process: start no more processes per node than "
                           f"it has visible GPUs ({torch.cuda.device_count()}), give each task its own GPU "
                           "(CUDA_VISIBLE_DEVICES), or use --backend gloo") from None


def info(backend: str | None = None, local_stages: int = 1) -> DistInfo:
    """The current process's place, once the group is up (device as in `init`)."""
    backend, device_type = pick_backend(backend)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = local_devices(device_type, local_rank, local_stages)[0]
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def destroy(drain: bool = True, drain_s: float = 30.0) -> None:
    """Leave every process group, last of all: free whatever holds a group first (DDP, a trainer).

    Why the order matters, and the drain: a gloo group's destructor joins its worker threads,
    and runs in whatever frees the group's last reference, holding the GIL. A worker thread
    that still wants the GIL then (to run, or to free, the Python callback of DDP's comm hook,
    which it does just after DDP's wait returns) never gets it: the process hangs for ever in
    C, where no Python timeout can fire (the suite once did, freeing a DDP model after its group).
    So: a garbage collection frees the wrappers left in reference cycles while their groups
    still live; a barrier on every group this rank belongs to (in creation order, the same on
    every rank) waits on outstanding work with the GIL released, so those threads finish; then
    the groups go. A barrier that fails or outlasts `drain_s` (a peer already gone) ends the
    drain. After a failure pass `drain=False`: a peer may still wait in a collective that a
    barrier would be matched with.
    """
    if not dist.is_initialized():
        return
    gc.collect()
    for group in _member_groups() if drain else []:
        try:
            dist.barrier(group=group, async_op=True).wait(datetime.timedelta(seconds=drain_s))
        except RuntimeError:  # DistError and friends: a peer left first
            break
    dist.destroy_process_group()


def _member_groups() -> list:
    """Every group this rank belongs to, the default one first, in the order they were made."""
    names = getattr(dist.distributed_c10d, "_world", None)
    groups = list(names.pg_names) if names is not None else []  # dict: insertion (creation) order
    default = dist.distributed_c10d._get_default_group()
    return [default] + [g for g in groups if g is not default]


