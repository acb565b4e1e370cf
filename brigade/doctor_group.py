"""`brigade doctor`'s checks that need the whole group, one process per rank as in training: an
all-reduce and point-to-point transfers (their data checked, their latency and bandwidth
measured), the snapshot folder (writable, the same on every node) and the clocks; and `Check`,
the verdict every check of the doctor returns. `doctor.group_worker` runs them in each rank;
the checks a node makes alone, and the command, are `brigade.doctor`'s.
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

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

