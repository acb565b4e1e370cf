"""`brigade doctor`: will a run work on this machine, and across these machines?

Run it on every node with the flags you would give `brigade train`. First the checks this node
can make alone (backend and device, port, rendezvous endpoint, the address it advertises), then,
through the same elastic launch as training, the checks that need the whole group: an all-reduce
and point-to-point transfers with their latency and bandwidth, the snapshot folder (writable, and
the same folder on every node), and the clocks (`brigade.doctor_group`). Each check prints PASS,
FAIL or SKIP (no peer to check with); a FAIL says how to fix it.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from brigade.config import ParallelConfig
from brigade.config.fielddoc import doc, sentence
from brigade.doctor_group import Check, _allreduce, _clock, _folder, _folder_check, _p2p
from brigade.errors import BrigadeError, RunError
from brigade.host import net
from brigade.launcher import agent, groups
from brigade.launcher.rendezvous import LaunchSpec


@dataclass
class Setup:
    """What `brigade train` would be given: the group's shape and where it keeps snapshots.
    Each field's sentence is its flag's help (`fielddoc.doc`), train's own where they agree."""

    nproc: int = doc(2, sentence(ParallelConfig, "nproc"))
    nnodes: int = doc(1, "machines in the run, each running brigade doctor with its own --node-rank")
    node_rank: int = doc(0, sentence(ParallelConfig, "node_rank"))
    rdzv_endpoint: str = doc("", sentence(ParallelConfig, "rdzv_endpoint"))
    local_addr: str = doc("", sentence(ParallelConfig, "local_addr"))
    backend: str = doc("auto", sentence(ParallelConfig, "backend"))
    out: str = doc("runs/latest", "the snapshot folder to check: writable, and the same on every node")
    port: int | None = doc(None, "single node: the rendezvous port to check; unset: a free one")


# --- checks this node makes alone -------------------------------------------------------------

def check_backend(s: Setup) -> Check:
    try:
        backend, device = groups.pick_backend(s.backend)
    except BrigadeError as exc:
        return _failed("backend", exc)
    available = dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available()
    if not available:
        return Check("backend", False, f"this torch build has no {backend}",
                     "install a torch build with it (the CPU and CUDA wheels both have gloo)")
    what = f"{backend} on {device}, torch {torch.__version__}"
    if device == "cuda":
        gpus = torch.cuda.device_count()
        if gpus < s.nproc:
            return Check("backend", False, f"{what}: {gpus} GPUs visible for --nproc {s.nproc}",
                         f"use --nproc {gpus} or fewer, or check CUDA_VISIBLE_DEVICES")
        what += f", {gpus} GPUs"
    else:
        what += f", {os.cpu_count()} CPU cores for {s.nproc} processes"
    return Check("backend", True, what)


def check_port(s: Setup) -> Check | None:
    if s.nnodes > 1 and s.node_rank > 0:
        return None  # nothing to bind here: node 0 hosts the rendezvous
    host, port = ("0.0.0.0", _endpoint(s)[1]) if s.nnodes > 1 else ("127.0.0.1", s.port)
    if port is None:
        return Check("port", True, f"a free loopback port for the rendezvous ({net.free_port()})")
    try:
        net.check_port(port, host)
    except BrigadeError:
        return Check("port", False, f"{port} is already in use on this node",
                     "stop what holds it (`ss -ltnp | grep :PORT`), or choose another port")
    return Check("port", True, f"{port} is free on this node")


def check_endpoint(s: Setup) -> Check:
    if s.nnodes == 1:
        return Check("endpoint", True, "single node: the rendezvous stays on loopback (127.0.0.1)")
    host, port = _endpoint(s)
    if s.node_rank == 0:
        try:
            ip = socket.gethostbyname(host)
        except OSError:
            return Check("endpoint", False, f"{host} does not resolve", "give node 0's own IP address")
        if net.interface_of(ip) is None:
            return Check("endpoint", False, f"{host} is not an address of this node, and node 0 hosts "
                         "the rendezvous", "run node 0 on the machine that owns that address, or "
                         "put one of this node's addresses in --rdzv-endpoint")
        return Check("endpoint", True, f"{host}:{port} is this node's; the others will connect to it")
    start = time.perf_counter()
    try:
        net.check_reachable(host, port)
    except BrigadeError:
        return Check("endpoint", False, f"nothing answers at {host}:{port}",
                     "start node 0 first (`brigade doctor --node-rank 0 ...` or its training), "
                     "and check the address and the firewall between the nodes")
    return Check("endpoint", True, f"{host}:{port} answers ({(time.perf_counter() - start) * 1e3:.1f} ms)")


def check_address(s: Setup) -> Check | None:
    if s.nnodes == 1:
        return None
    host, port = _endpoint(s)
    try:
        me = net.node_address(host, port, s.local_addr)
    except BrigadeError as exc:
        return _failed("address", exc)
    if me.ifname is None:
        return Check("address", False, f"{me.addr} is not on any interface of this node",
                     "give --local-addr one of this node's own addresses (see `ip -4 addr`)")
    detail = f"advertises {me.addr} on {me.ifname}"
    if not me.hostname_ok:
        names = ", ".join(sorted(net.hostname_addresses())) or "nothing"
        detail += (f"; the hostname resolves to {names}, not {me.addr}: brigade pins the address "
                   f"itself (plain torchrun would need --local-addr {me.addr}, --rdzv-conf is_host=1 "
                   f"on node 0, and GLOO_SOCKET_IFNAME={me.ifname})")
    return Check("address", True, detail)


def _failed(name: str, exc: BrigadeError) -> Check:
    """A FAIL from brigade's own error, whose text reads "what was wrong: how to fix it"."""
    detail, _, fix = str(exc).partition(": ")
    return Check(name, False, detail, fix)


def _endpoint(s: Setup) -> tuple[str, int]:

    return net.parse_endpoint(s.rdzv_endpoint)


def local_checks(s: Setup) -> list[Check]:
    checks = [check_backend(s), check_port(s), check_endpoint(s), check_address(s)]
    return [c for c in checks if c is not None]


def group_worker(s: Setup, big: int) -> list[dict]:
    """One rank of the doctor's group; returns every group check (the same list on every rank)."""
    info = groups.init(s.backend, threads=1, timeout_s=120)
    rank, world = info.rank, info.world_size
    token = [os.urandom(4).hex()]
    dist.broadcast_object_list(token, src=0)
    nonce = int(token[0], 16)  # fresh each run: no rank can know another's data in advance
    node = int(os.environ.get("GROUP_RANK", s.node_rank))
    checks = [_allreduce(info.device, world, rank, big, nonce), _p2p(info.device, world, rank, big, nonce)]
    views = [None] * world
    dist.all_gather_object(views, _folder(s.out, node, s.nnodes, info.local_rank, token[0]))
    checks.append(_folder_check(s.out, [v for v in views if v is not None], s.nnodes))
    checks.append(_clock(world, rank, info.local_rank, info.device))
    result = [[asdict(c) for c in checks if c is not None]]
    dist.broadcast_object_list(result, src=0)  # rank 0 holds the p2p and clock verdicts
    return result[0]


def run_doctor(s: Setup, say=print, big: int = 1 << 20) -> bool:
    """Print every check; True if all passed."""
    where = f"node {s.node_rank} of {s.nnodes}, rendezvous {s.rdzv_endpoint}" if s.nnodes > 1 \
        else f"one node, {s.nproc} processes"
    say(f"brigade doctor: {where}")
    checks = local_checks(s)
    for c in checks:
        say(c.line())
    if not all(c.ok for c in checks):
        say("group checks skipped: fix the FAILs above first")
        return False
    try:
        spec = LaunchSpec(s.nproc, port=s.port, nnodes=s.nnodes, node_rank=s.node_rank,
                                rdzv_endpoint=s.rdzv_endpoint, local_addr=s.local_addr, rdzv_timeout=60)
        results = agent.launch(group_worker, spec, s, big)
    except RunError as exc:
        say(Check("group", False, str(exc), "run `brigade doctor` with the same --nnodes and "
                  "--rdzv-endpoint on every node within a minute; see the FAILs above").line())
        return False
    group = [Check(**c) for c in next(iter(results.values()))]
    for c in group:
        say(c.line())
    ok = all(c.ok for c in group)
    say("brigade doctor: all checks passed" if ok else "brigade doctor: some checks FAILED (see fix: lines)")
    return ok
