"""Processes and groups: torchrun's environment in, process groups and devices out.

`launch(fn, nproc)` starts `nproc` workers through torch's elastic agent (what
torchrun runs), so a brigade script behaves the same whether it launches
itself or runs under `torchrun`. Inside a worker, `init()` reads the
environment the agent set and joins the process group.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from brigade import forensics, rendezvous
from brigade.elastic import rendezvous_failed
from brigade.errors import BrigadeError, RunError
from brigade.launchenv import launcher_env, slurm_env
from brigade.net import free_port
from brigade.rendezvous import LaunchSpec


class Stopped(Exception):
    """The launcher received a signal (SIGTERM, SIGINT); its workers were stopped."""

    def __init__(self, signame: str):
        super().__init__(signame)
        self.signame = signame


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
        dist.init_process_group(backend, **kwargs)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


init_single_or_env = init


def info(backend: str | None = None, local_stages: int = 1) -> DistInfo:
    """The current process's place, once the group is up (device as in `init`)."""
    backend, device_type = pick_backend(backend)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = local_devices(device_type, local_rank, local_stages)[0]
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(fn: Callable[..., Any], spec: LaunchSpec | int, *args: Any) -> dict[int, Any]:
    """Run `fn(*args)` in `spec.nproc` processes under torch's elastic agent; returns {rank: result}.

    Single-node: the rendezvous binds to loopback. Several nodes: every node runs this with the
    same `spec.rdzv_endpoint` (node 0's HOST:PORT); node 0 hosts the store. Each node advertises
    `spec.local_addr`, by default the address that routes to node 0, and pins gloo (and NCCL's
    bootstrap) to that address's interface unless the environment already names one, so a
    hostname that resolves to loopback or to nothing does not matter (`brigade.rendezvous`).
    `fn` must be importable. `spec.min_nodes` > 0: elastic (`brigade.elastic.rendezvous_failed`).

    Args:
        spec: a `LaunchSpec` (`LaunchSpec.from_parallel` for a run), or just a process count.

    Raises:
        BrigadeError: the port is taken. RunError: a worker failed (its message, one line), or
            the nodes did not meet within `spec.rdzv_timeout`. Stopped: the agent got a signal.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    spec = spec if isinstance(spec, LaunchSpec) else LaunchSpec(spec)
    if spec.nproc < 1:
        raise BrigadeError(f"nproc={spec.nproc}: need at least 1 process")
    meet = rendezvous.multi_node(spec) if spec.nnodes > 1 else rendezvous.single_node(spec)
    if spec.quiet:  # the caller may have its own handlers on these loggers (see train/events.py)
        for name in ("torch.distributed.elastic", "torch.multiprocessing.spawn"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        with _environment(_worker_env(spec, meet)):
            return elastic_launch(_launch_config(spec, meet), _call_and_leave)(fn, *args)
    except ChildFailedError as exc:
        raise RunError(_first_failure(exc)) from None
    except RendezvousError as exc:
        if spec.min_nodes:
            raise RunError(rendezvous_failed(spec.min_nodes, meet.endpoint, spec.rdzv_timeout, exc)) from None
        raise RunError(f"the nodes could not meet at the rendezvous {meet.endpoint} ({type(exc).__name__}): "
                       "start every node with the same --nnodes and --rdzv-endpoint, and run "
                       "`brigade doctor` on each to see what blocks them") from None
    except SignalException as exc:  # the agent was told to stop; it stopped the workers too
        raise Stopped(signal.Signals(exc.sigval).name) from None


def _worker_env(spec: LaunchSpec, meet: rendezvous.Rendezvous) -> dict[str, str]:
    """Variables for the agent and its workers (those the user has set win)."""
    env = {"OMP_NUM_THREADS": str(spec.threads_per_proc),  # also silences torchrun's note
           # Without the agent's shared store the workers' store is rank 0's, which brigade binds
           # to loopback on one node; and with it, a node that rejoins after a crash waits forever
           # for a MASTER_ADDR published only in its first round (pytorch/pytorch#135712).
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "BRIGADE_AGENT_STORE": meet.endpoint}  # for the hang watchdogs (forensics.py)
    if meet.ifname:  # gloo (and NCCL's bootstrap) on the interface the peers reach
        env.update(GLOO_SOCKET_IFNAME=meet.ifname, NCCL_SOCKET_IFNAME=meet.ifname)
    return env


def _launch_config(spec: LaunchSpec, meet: rendezvous.Rendezvous):
    """torch's LaunchConfig for this spec and rendezvous."""
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=spec.min_nodes or spec.nnodes, max_nodes=spec.nnodes, nproc_per_node=spec.nproc,
        run_id=uuid.uuid4().hex[:8] if spec.nnodes == 1 else f"brigade-{meet.endpoint}",
        rdzv_backend="c10d", rdzv_endpoint=meet.endpoint, rdzv_configs=meet.configs,
        max_restarts=spec.max_restarts, monitor_interval=0.1, start_method="spawn",
        logs_specs=_logs_specs(spec.log_dir), local_addr=meet.local_addr,
    )


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """Set variables the user has not set, for the agent and its workers; restore them after."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _call_and_leave(fn: Callable[..., Any], *args: Any) -> Any:
    """Worker body: run the user's function, then leave the process group cleanly.

    After a stop signal the process leaves as soon as its result is handed over (see
    `_leave_once_handed_over`): the agent that sent the signal waits for it to exit.
    """
    watch_signals()
    try:
        return fn(*args)
    finally:
        forensics.stop_all()  # their store connections first, while every store still answers
        destroy()
        _returned.set()
        if stop_requested():
            _leave_once_handed_over()


# --- stop signals -----------------------------------------------------------------------------
# SIGTERM (a scheduler's preemption, or the elastic agent passing its own on) asks a worker to
# finish its step, snapshot and leave. The agent, meanwhile, waits up to 30 s for its workers to
# exit and then kills them. But torch's spawn wrapper (elastic/multiprocessing/api.py `_wrap`)
# does not exit when our function returns: it puts the result in a pipe and waits for the agent
# to read it, which an agent that is shutting down never does. So a stopped worker exits by
# itself once its result is in the pipe: an agent still running reads it from there.

_STOP_SIGNALS = (signal.SIGTERM,)
_stop_signal: list[str] = []  # the name of the first stop signal received, if any
_returned = threading.Event()  # the worker function has returned (or raised)
_leaving = threading.Event()


def watch_signals() -> None:
    """Turn SIGTERM into a request to stop (`stop_requested()`) instead of death. Main thread only."""
    for sig in _STOP_SIGNALS:
        signal.signal(sig, _on_stop_signal)


def stop_requested() -> bool:
    """Whether this process was sent a stop signal (see `watch_signals`)."""
    return bool(_stop_signal)


def _on_stop_signal(signum: int, frame: Any) -> None:
    if not _stop_signal:
        _stop_signal.append(signal.Signals(signum).name)
    if _returned.is_set():  # the signal came after the result was handed over, or while it is
        _leave_once_handed_over()


def _leave_once_handed_over(poll_s: float = 0.02) -> None:
    """Exit (status 0) as soon as the main thread waits in torch's `_wrap` after its put."""
    if _leaving.is_set():
        return
    _leaving.set()
    main = threading.main_thread().ident

    def watch() -> None:
        while True:
            if _waiting_in_wrap(sys._current_frames().get(main)):
                for stream in (sys.stdout, sys.stderr):
                    with contextlib.suppress(Exception):
                        stream.flush()
                os._exit(0)
            time.sleep(poll_s)

    threading.Thread(target=watch, name="brigade-leave", daemon=True).start()


def _waiting_in_wrap(frame: Any) -> bool:
    """True when `frame`'s stack is torch's `_wrap` waiting for the agent, its result already put.

    Not under torch's spawn wrapper (torchrun's own subprocesses, srun): False, and the process
    exits by itself when the function returns.
    """
    callee = None
    while frame is not None:
        if frame.f_code.co_name == "_wrap" and "elastic" in frame.f_code.co_filename:
            return callee is not None and callee.f_code.co_name == "wait"
        callee, frame = frame, frame.f_back
    return False


def _logs_specs(log_dir: str | None):
    """With a log folder, every worker's stderr (tracebacks, C++ frames) goes to a file there."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    return DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ERR) if log_dir else DefaultLogsSpecs()


def _first_failure(exc) -> str:
    """One line from a ChildFailedError: which rank, and its exception message."""
    rank, failure = min(exc.failures.items(), key=lambda kv: kv[1].timestamp or 0)
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message
    text = str(message).strip()
    last = text.splitlines()[-1] if text else ""
    errors = "BrigadeError|SnapshotError|RunError|PlanError|StageAborted|HangError"
    last = re.sub(rf"^[\w.]*({errors}): ", "", last)
    if failure.signal_name() != "<N/A>" and failure.signal_name():
        return f"worker rank {rank} died ({failure.signal_name()})"
    return f"worker rank {rank} failed: {last or 'exit code ' + str(failure.exitcode)}"
