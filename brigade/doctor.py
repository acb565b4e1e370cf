"""`brigade doctor`: will a run work on this machine, and across these machines?

Run it on every node with the flags you would give `brigade train`. First the checks this node
can make alone (backend and device, port, rendezvous endpoint, the address it advertises), then,
through the same elastic launch as training, the checks that need the whole group: an all-reduce
and point-to-point transfers with their latency and bandwidth, the snapshot folder (writable, and
the same folder on every node), and the clocks. Each check prints PASS, FAIL or SKIP (no peer to
check with); a FAIL says how to fix it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from brigade.config import ParallelConfig
from brigade.config.fielddoc import doc, sentence
from brigade.errors import BrigadeError, RunError
from brigade.host import net
from brigade.launcher import agent, groups
from brigade.launcher.rendezvous import LaunchSpec
from brigade.measure.timing import measure, ping_pong

MAX_SKEW_S = 1.0


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    skipped: bool = False  # nothing to check here (e.g. no peer): not a failure

    def line(self) -> str:
        verdict = "SKIP" if self.skipped else "PASS" if self.ok else "FAIL"
        return f"{verdict}  {self.name:<16}{self.detail}" + (f"\n      fix: {self.fix}" if self.fix else "")


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


# --- checks the whole group makes together (one process per rank, as in training) -------------

def _timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of `fn()` over `repeats` runs, after one warm-up run."""
    return statistics.median(measure(fn, repeats, warmup=1, device=device).samples)


def sender_data(sender: int, nonce: int, n: int, device: torch.device) -> torch.Tensor:
    """Random values only rank `sender` sends (seeded by its rank and the run's nonce); a receiver
    regenerates them to check, never pre-fills its buffer with them, so lost data cannot pass."""
    g = torch.Generator().manual_seed((nonce * 1_000_003 + sender) % 2**63)
    return torch.rand(n, generator=g).to(device)


def _everyone(error: str, world: int) -> str:
    """The first rank's error (or "" on every rank), known to every rank."""
    errors = [""] * world
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), "")


def _allreduce(device: torch.device, world: int, rank: int, big: int, nonce: int = 0) -> Check:
    x = sender_data(rank, nonce, 4096, device)
    dist.all_reduce(x)
    want = sum(sender_data(r, nonce, 4096, torch.device("cpu")) for r in range(world))
    worst = (x.cpu() - want).abs().max().item()
    error = _everyone(f"rank {rank} got a sum of every rank's random data off by up to {worst:.3g}"
                      if worst > 1e-4 * world else "", world)
    if error:
        return Check("all-reduce", False, error, "ranks disagree on the group or data is lost: check "
                     "that every node runs the same brigade and torch, and the network between them")
    one, payload = torch.zeros(1, device=device), torch.zeros(big, device=device)
    lat = _timed(lambda: dist.all_reduce(one), 20, device)
    if world == 1:  # nothing crosses a link: no bandwidth to report
        return Check("all-reduce", True, f"correct on 1 rank, no link to measure; latency {lat * 1e3:.2f} ms")
    t = _timed(lambda: dist.all_reduce(payload), 3, device)
    nbytes = payload.numel() * payload.element_size()
    busbw = 2 * (world - 1) / world * nbytes / t  # what each link carries in a ring all-reduce
    return Check("all-reduce", True, f"correct across {world} ranks; latency {lat * 1e3:.2f} ms; "
                 f"{nbytes >> 20} MiB in {t * 1e3:.1f} ms ({busbw / 1e9:.2f} GB/s per link)")


def _delivered(device: torch.device, rank: int, other: int, big: int, nonce: int) -> str:
    """Each side sends its own random data and checks the other's: "" or what went wrong."""
    mine = sender_data(rank, nonce, big, device)
    got = torch.full_like(mine, float("nan"))
    ping_pong(mine, other, rank == 0, recv=got)
    ok = torch.equal(got, sender_data(other, nonce, big, device))
    return "" if ok else f"what rank {other} sent arrived altered at rank {rank}"


def _p2p(device: torch.device, world: int, rank: int, big: int, nonce: int = 0) -> Check | None:
    """Rank 0 exchanges data with every other rank, both ways; the slowest pair is reported."""
    if world == 1:
        return Check("point-to-point", True, "skipped: 1 process, no peer", skipped=True)
    small, payload = torch.zeros(1, device=device), torch.zeros(big, device=device)
    worst, error = (0.0, 0.0, 0), ""  # (latency, seconds for the payload, peer), first failure
    for peer in range(1, world):
        if rank not in (0, peer):
            dist.barrier()
            continue
        other = peer if rank == 0 else 0
        error = error or _delivered(device, rank, other, big, nonce)
        lat = _timed(lambda o=other: ping_pong(small, o, rank == 0), 20, device) / 2
        secs = _timed(lambda o=other: ping_pong(payload, o, rank == 0), 3, device) / 2
        worst = max(worst, (lat, secs, peer))
        dist.barrier()
    error = _everyone(error, world)
    if rank != 0:
        return None
    if error:
        return Check("point-to-point", False, error, "the network corrupts or drops data: check the "
                     "interface, its MTU, and any NCCL_* or GLOO_* settings")
    (lat, secs, peer), nbytes = worst, big * 4
    return Check("point-to-point", True, f"rank 0 ↔ every rank, data checked both ways; slowest: "
                 f"rank {peer}, latency {lat * 1e3:.2f} ms, {nbytes >> 20} MiB in {secs * 1e3:.1f} ms "
                 f"({nbytes / secs / 1e9:.2f} GB/s)")


def _folder(out: str, node: int, nnodes: int, local_rank: int, token: str) -> dict | None:
    """Each node's first process writes a marker in OUT, then reads everyone's back."""
    probe = Path(out) / f".doctor-{token}"
    mine, error = probe / f"node{node}", ""
    created = not Path(out).exists()  # an OUT that the doctor made is removed again
    dist.barrier()
    if local_rank == 0:
        try:
            probe.mkdir(parents=True, exist_ok=True)
            mine.write_text(f"node {node}\n")
        except OSError as exc:
            error = exc.strerror or str(exc)
    dist.barrier()
    seen = sorted(p.name for p in probe.glob("node*")) if local_rank == 0 and not error else []
    free = shutil.disk_usage(probe).free if local_rank == 0 and not error else 0
    dist.barrier()
    if local_rank == 0 and node == 0:
        shutil.rmtree(probe, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                Path(out).rmdir()
    return {"node": node, "error": error, "seen": seen, "free": free} if local_rank == 0 else None


def _folder_check(out: str, views: list[dict], nnodes: int) -> Check:
    for v in views:
        if v["error"]:
            return Check("snapshot folder", False, f"node {v['node']} cannot write in {out} ({v['error']})",
                         "choose an --out that every node can write, or fix its permissions")
    expected = [f"node{k}" for k in range(nnodes)]
    for v in views:
        if v["seen"] != expected:
            return Check("snapshot folder", False, f"{out} on node {v['node']} does not show the other "
                         "nodes' files: it is not the same folder everywhere",
                         "mount one shared file system (NFS, Lustre, ...) at the same path on every node")
    free = min(v["free"] for v in views) / 2**30
    where = "shared by every node" if nnodes > 1 else "on this node"
    return Check("snapshot folder", True, f"{out} is writable and {where}; {free:.1f} GiB free")


def _clock(world: int, rank: int, local_rank: int, device: torch.device) -> Check | None:
    """NTP-style offset of every node's clock from node 0's, through rank 0."""
    leaders = [0] * world
    dist.all_gather_object(leaders, local_rank == 0)
    peers = [r for r in range(1, world) if leaders[r]]
    worst, t = (0.0, 0.0, 0), torch.zeros(1, dtype=torch.float64, device=device)
    for peer in peers:  # under NCCL, recv returns before the data is there: .item() waits for it
        if rank == 0:
            t0 = time.time()
            dist.send(torch.tensor([t0], dtype=torch.float64, device=device), peer)
            dist.recv(t, peer)
            theirs, t1 = t.item(), time.time()  # .item() first: the data is there
            worst = max(worst, (abs(theirs - (t0 + t1) / 2), (t1 - t0) / 2, peer))
        elif rank == peer:
            dist.recv(t, 0)
            t.item()
            dist.send(torch.tensor([time.time()], dtype=torch.float64, device=device), 0)
    return skew_check(worst if peers else None) if rank == 0 else None


def skew_check(worst: tuple[float, float, int] | None) -> Check:
    """From the largest |offset| (seconds), its uncertainty and the rank it was measured on."""
    if worst is None:
        return Check("clock skew", True, "one node: one clock")
    skew, err, peer = worst
    if skew > MAX_SKEW_S:
        return Check("clock skew", False, f"rank {peer}'s clock is {skew:.2f} s off rank 0's",
                     "synchronise the clocks (chrony, ntpd or systemd-timesyncd) on every node")
    return Check("clock skew", True, f"at most {skew * 1e3:.1f} ms (± {err * 1e3:.1f} ms) between nodes")


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
