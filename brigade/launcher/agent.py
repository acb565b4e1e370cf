"""Starting workers under torch's elastic agent (what torchrun runs), and leaving cleanly.

`launch(fn, spec)` starts `spec.nproc` workers through the agent, so a brigade script behaves
the same whether it launches itself or runs under torchrun: restarts, c10d rendezvous and
many nodes come from torch. Stop signals (SIGTERM) are turned into a clean stop: the workers
finish their step, snapshot and leave (`watch_signals`, `stop_requested`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from brigade import forensics
from brigade.errors import BrigadeError, RunError
from brigade.launcher import groups, rendezvous
from brigade.launcher.rendezvous import LaunchSpec


class Stopped(Exception):
    """The launcher received a signal (SIGTERM, SIGINT); its workers were stopped."""

    def __init__(self, signame: str):
        super().__init__(signame)
        self.signame = signame


def launch(fn: Callable[..., Any], spec: LaunchSpec | int | None = None, *args: Any,
           nproc: int | None = None) -> dict[int, Any]:
    """Run `fn(*args)` in `spec.nproc` processes under torch's elastic agent; returns {rank: result}.

    Single-node: the rendezvous binds to loopback. Several nodes: every node runs this with the
    same `spec.rdzv_endpoint` (node 0's HOST:PORT); node 0 hosts the store. Each node advertises
    `spec.local_addr`, by default the address that routes to node 0, and pins gloo (and NCCL's
    bootstrap) to that address's interface unless the environment already names one, so a
    hostname that resolves to loopback or to nothing does not matter (`brigade.launcher.rendezvous`).
    `fn` must be importable.

    Elastic (`spec.min_nodes` > 0): the agent trains on whichever of min_nodes..nnodes nodes
    are present. A lost node fails the others' workers; the agent restarts them (one of
    `spec.max_restarts`) once the rendezvous has min_nodes again, waiting `spec.last_call`
    seconds for more, up to `spec.rdzv_timeout`. A node that arrives while training runs makes
    every agent stop its workers (SIGTERM: step, snapshot, leave) and meet again with it (no
    restart counted). Too few nodes in time: `brigade.launcher.rendezvous.rendezvous_failed`.

    Args:
        spec: a `LaunchSpec` (`LaunchSpec.from_parallel` for a run), or just a process count.
        nproc: the process count, by name (`launch(main, nproc=2)`), when `spec` is not given.

    Raises:
        BrigadeError: the port is taken. RunError: a worker failed (its message, one line), or
            the nodes did not meet within `spec.rdzv_timeout`. Stopped: the agent got a signal.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    if (spec is None) == (nproc is None):
        raise BrigadeError("launch: give the process count once, as launch(fn, 2) or launch(fn, nproc=2)")
    spec = spec if isinstance(spec, LaunchSpec) else LaunchSpec(nproc if spec is None else spec)
    if spec.nproc < 1:
        raise BrigadeError(f"nproc={spec.nproc}: need at least 1 process")
    meet = rendezvous.multi_node(spec) if spec.nnodes > 1 else rendezvous.single_node(spec)
    if spec.quiet:  # the caller may have its own handlers on these loggers (see train/supervise.py)
        for name in ("torch.distributed.elastic", "torch.multiprocessing.spawn"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        with _environment(_worker_env(spec, meet)), _ready_to_fork():
            return elastic_launch(_launch_config(spec, meet), _call_and_leave)(fn, *args)
    except ChildFailedError as exc:
        raise RunError(_first_failure(exc)) from None
    except RendezvousError as exc:
        if spec.min_nodes:
            why = rendezvous.rendezvous_failed(spec.min_nodes, meet.endpoint, spec.rdzv_timeout, exc)
            raise RunError(why) from None
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
           "BRIGADE_AGENT_STORE": meet.endpoint,  # for the hang watchdogs (forensics.py)
           "BRIGADE_NODE": str(spec.node_rank)}  # names this node in elastic layout records
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
        max_restarts=spec.max_restarts, monitor_interval=0.1, start_method=_start_method(),
        logs_specs=_logs_specs(spec.log_dir), local_addr=meet.local_addr,
    )


def _start_method() -> str:
    """How the agent starts its workers: "fork" where it is safe, since a forked worker starts
    with torch already loaded (about 2 s of imports saved per process); "spawn" with a GPU
    (CUDA cannot be used in a forked child), when this process has a process group of its
    own (the child would inherit it, with none of the threads behind it). A parent that has
    compiled forks safely too: `_forget_compile_threads` runs in every forked child."""
    import torch
    import torch.distributed as dist

    return "spawn" if torch.cuda.is_available() or dist.is_initialized() else "fork"


@contextlib.contextmanager
def _ready_to_fork():
    """While the agent starts (and restarts) forked workers: what each would import on its own
    is imported here once, and the objects the agent holds are frozen out of the cyclic garbage
    collector, as Python's `gc.freeze` documents for a parent that forks.

    - torch._dynamo (0.6 s here), which a run's first FLOP count (`train.mfu`) pulls in;
    - frozen, the ~300,000 objects of torch and brigade a worker inherits are no longer walked by
      each of its full collections (0.1 s each). A tiny run's workers spend much of their time
      in Python, and its collector with them: the exact-resume world of ep 2 × pp 2 (24 runs in
      4 processes) took 80 s, 68 s frozen.

    Garbage is collected first, so none is frozen; the agent's objects are unfrozen once its
    workers are done. Under "spawn" nothing is inherited and nothing is done. No thread starts
    at the import, so the fork stays safe."""
    if _start_method() != "fork":
        yield
        return
    import torch._dynamo  # noqa: F401

    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _forget_compile_threads() -> None:
    """In a forked child: drop the thread pool inductor compiles on, if this process had one.

    A forked child has its parent's pool object but none of its threads, so the first compile
    waits for ever on work nobody takes (CI's timeout of `brigade bench --compile` in a test
    process that had compiled before). torch resets its process pools after a fork, not this
    one; cleared, the child makes its own."""
    module = sys.modules.get("torch._inductor.async_compile")
    if module is not None:
        module.AsyncCompile.pool.cache_clear()


os.register_at_fork(after_in_child=_forget_compile_threads)


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


# A worker whose peer died fails at once on the broken connection, often before the agent's next
# poll has seen the death; the agent then reports only this symptom. Waiting a few polls first
# lets the dead peer (its signal, its error) be the failure the agent names.
_PEER_GONE = re.compile(r"Connection (closed|reset) by peer|remote (worker|process)|"
                        r"NCCL communicator was aborted")
_CAUSE_FIRST_S = 0.5


def _call_and_leave(fn: Callable[..., Any], *args: Any) -> Any:
    """Worker body: run the user's function, then leave the process group cleanly.

    After a stop signal the process leaves as soon as its result is handed over (see
    `_leave_once_handed_over`): the agent that sent the signal waits for it to exit.
    """
    watch_signals()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # a forked worker kept the agent's count
        import torch

        torch.set_num_threads(int(threads))
    failed = True
    try:
        result = fn(*args)
        failed = False
        return result
    except Exception as exc:
        if _PEER_GONE.search(str(exc)):  # the agent reports one failure: let it be the cause
            time.sleep(_CAUSE_FIRST_S)
        raise
    finally:
        forensics.stop_all()  # their store connections first, while every store still answers
        groups.destroy(drain=not failed)  # after a failure, no barrier a waiting peer could meet
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
_stop_at: list[float] = []  # when it came (time.monotonic)
_returned = threading.Event()  # the worker function has returned (or raised)
_leaving = threading.Event()


def watch_signals() -> None:
    """Turn SIGTERM into a request to stop (`stop_requested()`) instead of death. Main thread only."""
    for sig in _STOP_SIGNALS:
        signal.signal(sig, _on_stop_signal)


def stop_requested() -> bool:
    """Whether this process was sent a stop signal (see `watch_signals`)."""
    return bool(_stop_signal)


def seconds_since_stop() -> float:
    """Seconds since the first stop signal (0 before any: a stop asked another way is new)."""
    return time.monotonic() - _stop_at[0] if _stop_at else 0.0


def _on_stop_signal(signum: int, frame: Any) -> None:
    if not _stop_signal:
        _stop_signal.append(signal.Signals(signum).name)
        _stop_at.append(time.monotonic())
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
    """One line from a ChildFailedError: which rank, and its exception message.

    A worker killed by a signal comes first: its peers then fail on the broken connection, often
    within the same second (timestamps are whole seconds), and are not the cause.
    """
    def killed(failure) -> bool:
        return failure.signal_name() not in ("<N/A>", "", None)

    rank, failure = min(exc.failures.items(), key=lambda kv: (not killed(kv[1]), kv[1].timestamp or 0))
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message
    text = str(message).strip()
    last = text.splitlines()[-1] if text else ""
    errors = "BrigadeError|SnapshotError|RunError|PlanError|StageAborted|HangError"
    last = re.sub(rf"^[\w.]*({errors}): ", "", last)
    if killed(failure):
        return f"worker rank {rank} died ({failure.signal_name()})"
    return f"worker rank {rank} failed: {last or 'exit code ' + str(failure.exitcode)}"
