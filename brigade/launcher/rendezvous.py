"""Where the processes meet: what a launch needs (`LaunchSpec`), the rendezvous the agents use,
and the store a single node's workers use.

One node: everything stays on loopback. The agents' rendezvous store is served from a
loopback socket, and rank 0's process-group store too (`loopback_store`): torch's own
TCPStore would listen on every interface. Several nodes: node 0 hosts the rendezvous at
HOST:PORT (`net.parse_endpoint` reads it, the one parser of it), and each node advertises
the address that routes there (`net.node_address`), pinning gloo and NCCL to its interface.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from brigade.host.net import (
    check_port,
    check_reachable,
    interface_of,
    is_loopback,
    listen,
    node_address,
    parse_endpoint,
)

if TYPE_CHECKING:
    from brigade.config import ParallelConfig


@dataclass(frozen=True)
class LaunchSpec:
    """How `agent.launch` starts the workers on this node, and how the nodes meet.

    nnodes > 1: every node gives the same `rdzv_endpoint` (node 0's HOST:PORT) and its own
    `node_rank`; `local_addr` is what this node advertises (empty: the address routing to
    node 0). `min_nodes` > 0: elastic, on min_nodes..nnodes nodes, a node silent for
    `last_call` seconds once MIN are there no longer awaited.
    """

    nproc: int
    max_restarts: int = 0
    port: int | None = None  # one node: the rendezvous port (None: a free one)
    log_dir: str | None = None  # every worker's stderr into a file there
    threads_per_proc: int = 1
    quiet: bool = True  # silence the agent's loggers (False: the caller handles them)
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    local_addr: str = ""
    rdzv_timeout: int = 120
    min_nodes: int = 0
    last_call: int = 10

    @classmethod
    def from_parallel(cls, p: ParallelConfig, port: int | None = None, log_dir: str | None = None,
                      quiet: bool = True) -> LaunchSpec:
        """The launch a run's parallel configuration asks for (the one place that maps its fields)."""
        from brigade.config.elastic import first_nodes

        return cls(p.nproc, p.max_restarts, port, log_dir, p.threads, quiet, p.nnodes, p.node_rank,
                   p.rdzv_endpoint, p.local_addr, p.rdzv_timeout,
                   first_nodes(p) if p.min_nodes else 0, p.rdzv_last_call)


@dataclass
class Rendezvous:
    """Where this node's agent meets the others, and what it advertises."""

    endpoint: str  # HOST:PORT of the rendezvous store
    configs: dict[str, Any]  # torch's c10d rendezvous settings
    local_addr: str
    ifname: str | None  # the interface holding local_addr, for GLOO/NCCL_SOCKET_IFNAME
    server: Any = field(default=None, repr=False)  # one node: the store served, alive while held


def single_node(spec: LaunchSpec) -> Rendezvous:
    """The rendezvous store on loopback; torch's c10d backend finds it by port (multi_tenant)
    instead of opening one on every interface."""
    sock = listen("127.0.0.1", spec.port)
    port = sock.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True,
                           wait_for_workers=False, master_listen_fd=sock.detach())  # (owns the fd)
    return Rendezvous(f"127.0.0.1:{port}", {"timeout": spec.rdzv_timeout, "is_host": True},
                      "127.0.0.1", interface_of("127.0.0.1"), server)


def multi_node(spec: LaunchSpec) -> Rendezvous:
    """Node 0 checks it can host HOST:PORT, the others that it answers; each finds its address.

    Raises:
        BrigadeError: a malformed endpoint, a port taken, node 0 silent, or no route to it.
    """

    host, port = parse_endpoint(spec.rdzv_endpoint)
    check_port(port, host="0.0.0.0") if spec.node_rank == 0 else check_reachable(host, port)
    me = node_address(host, port, spec.local_addr)
    configs: dict[str, Any] = {"timeout": spec.rdzv_timeout, "is_host": spec.node_rank == 0}
    if spec.min_nodes:  # a node silent for 3 heartbeats of 2 s is dropped, not 3 × 5 s
        configs.update(join_timeout=spec.rdzv_timeout, last_call_timeout=spec.last_call,
                       keep_alive_interval=2)
    return Rendezvous(f"{host}:{port}", configs, me.addr, me.ifname)


def loopback_store(timeout: datetime.timedelta) -> dist.TCPStore | None:
    """A worker group's store on loopback when MASTER_ADDR is loopback (else None: torch's env://).

    torch's own TCPStore listens on every interface; a single-node run has no business there.
    """
    addr, port = os.environ.get("MASTER_ADDR", ""), int(os.environ.get("MASTER_PORT", "0"))
    if not is_loopback(addr) or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    world = int(os.environ["WORLD_SIZE"])
    if os.environ["RANK"] == "0":
        return dist.TCPStore(addr, port, world, is_master=True, timeout=timeout, wait_for_workers=False,
                             master_listen_fd=listen(addr, port).detach())  # the store owns the fd
    return dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)


def rendezvous_failed(min_nodes: int, endpoint: str, timeout: int, exc: Exception) -> str:
    """The one line for an elastic run whose nodes did not meet in time (too few for MIN or pp)."""
    return (f"fewer than {min_nodes} nodes met at the rendezvous {endpoint} within --rdzv-timeout "
            f"{timeout} s ({type(exc).__name__}): start more nodes with the same command, then run "
            "it again here to resume")
