"""What a device can do: peak FLOP/s, memory, links. A small built-in table of public figures, and
"cpu", this machine, measured by a short probe.

    H100 SXM    989 TFLOP/s bf16 dense, 67 fp32 (no TF32), 80 GB HBM3 3.35 TB/s, NVLink 900 GB/s
    H200 SXM    989 / 67 TFLOP/s, 141 GB HBM3e 4.8 TB/s, NVLink 900 GB/s
    A100 80 GB  312 TFLOP/s bf16 dense, 19.5 fp32, 80 GB HBM2e 2.04 TB/s, NVLink 600 GB/s

(NVIDIA's H100, H200 and A100 datasheets; NVLink's total is both directions, a ring step moves
one, so half of it is a link's bandwidth.) Between nodes: one 400 Gb/s NDR InfiniBand adapter per
GPU (A100: 200 Gb/s HDR), as DGX systems have, 50 (25) GB/s. Latencies are NCCL's usual few
microseconds. A TOML file (`cluster.py`) gives any other device.

"cpu" is this machine: one thread's fp32 matmul rate (and its bf16 one, for MFU only: the
planner times bf16 blocks here rather than scale them), how much slower each thread gets when every
core runs one (memory bandwidth shared), and gloo between two processes of this host, over
loopback (`gloo_probe`): point to point, each collective, and what a DTensor parameter adds to
the optimizer's step. The probe is kept for a day in the cache folder and reused by the next
command on this machine (`probe_cache`; `brigade plan --reprobe` measures again).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, fields

from brigade.errors import BrigadeError
from brigade.host.peaks import DENSE, MATMUL_N, half_matmul_seconds, matmul_seconds
from brigade.measure import gloo_probe
from brigade.planner import probe_cache

GB = 1e9


@dataclass(frozen=True)
class DeviceSpec:
    """One device (a GPU, or one CPU core running one process).

    Peaks are per device in FLOP/s (0: not known); bandwidths in bytes/s one way, latencies in
    seconds. `cores`: devices that share one host's compute (a CPU's cores; 0 for a GPU, which
    has its own); `shared_slowdown`: a device's time when all `cores` compute at once, over its
    time alone (memory bandwidth is shared; 1 for a GPU). Optional, 0 where not known:
    `all_reduce_bw`, `all_gather_bw`, `reduce_scatter_bw` and `coll_latency`, what a collective
    inside a node achieves in the ring formulas (0: the intra-node link's bandwidth and latency,
    as NCCL comes close to); `dtensor_step_s`, what AdamW's step adds per DTensor parameter;
    `action_s` and `runtime_step_s`, brigade's runtime's own seconds per action of a plan and
    per step (measured on "cpu"; 0, not counted, for the GPUs of the table: no measurement);
    `crowded_action_s`, the runtime's seconds per action where a host has more processes than
    `cores` (0: `action_s`); `tp_collective_s`, what one collective a tensor-parallel block
    issues through DTensor adds to its step at tp 2 beyond its bytes, as issued among the block's
    compute (the partner's lag included), and `crowded_tp_collective_s` the same where a host
    has more processes than `cores`, each collective waiting for its partner to get a core (0:
    not counted, and the planner prices tp's collectives by the ring formulas,
    `planner.split_costs`).

    What each kind of kernel reaches, as a share of the peak it runs against (`planner.kernels`;
    1: the peak itself, an upper bound, where nothing better is known): `matmul_eff` of the
    matmul peak for the precision (`peak_fp8` under float8, 0: not known); `attention_eff` and
    `attention_bwd_eff` a fused attention's forward and backward, of the half-precision peak;
    `mem_eff` a memory-bound kernel's bytes of `mem_bw`. The built-in GPUs' come from published
    measurements (`KERNELS`, cited in docs/plan.md); "cpu" measures its own (the probe's matmul
    and copy rates: 1 of what it measured). `reserve_frac`: the share of a step's allocated peak
    the CUDA caching allocator was measured holding beyond it (`planner.reserve`; 0: not measured).
    """

    name: str
    peak_bf16: float
    peak_fp32: float
    memory: float
    intra_bw: float
    intra_latency: float
    inter_bw: float
    inter_latency: float
    mem_bw: float
    cores: int = 0
    shared_slowdown: float = 1.0
    all_reduce_bw: float = 0.0
    all_gather_bw: float = 0.0
    reduce_scatter_bw: float = 0.0
    coll_latency: float = 0.0
    dtensor_step_s: float = 0.0
    action_s: float = 0.0
    runtime_step_s: float = 0.0
    crowded_action_s: float = 0.0
    tp_collective_s: float = 0.0
    crowded_tp_collective_s: float = 0.0
    peak_fp8: float = 0.0
    matmul_eff: float = 1.0
    attention_eff: float = 1.0
    attention_bwd_eff: float = 1.0
    mem_eff: float = 1.0
    reserve_frac: float = 0.0
    measured: bool = False  # probed here (cpu), not from a table or a file

    def peak(self, precision: str) -> float:
        """Peak FLOP/s for `precision` ("" or "fp32", "bf16").

        Raises:
            BrigadeError: the device has no known peak for it.
        """
        value = self.peak_bf16 if precision in ("bf16", "fp16") else self.peak_fp32
        if value <= 0:
            field = "peak_bf16" if precision in ("bf16", "fp16") else "peak_fp32"
            raise BrigadeError(
                f"device {self.name!r} has no known {precision or 'fp32'} peak: give "
                f"{field} (FLOP/s) in a --cluster file's [device] table"
            )
        return value


def _gpu(name: str, bf16: float, fp32: float, mem: float, nvlink: float, ib: float, hbm: float,
         **kernels: float) -> DeviceSpec:
    return DeviceSpec(
        name, bf16 * 1e12, fp32 * 1e12, mem * GB, nvlink / 2 * GB, 3e-6, ib * GB, 8e-6, hbm * GB, **kernels
    )


# What each kind of kernel reaches on the built-in GPUs, as a share of its peak (docs/plan.md has
# each source): matmuls, the maximum achievable matmul FLOP/s measured by Stas Bekman's
# mamf-finder (ml-engineering, compute/accelerator: H100 SXM 792.1 of 989, GH200 821.0 of 989
# for H200's Hopper, A100 SXM 267.9 of 312); attention, FlashAttention-2 as PyTorch's SDPA runs it,
# head dim 128 at sequence 8k: on H100 SXM5 333 TFLOP/s causal forward and 318 backward
# (FlashAttention-3 paper, Shah et al. 2024, figures of attention speed), on A100 50-73 % of peak
# (FlashAttention-2 paper, Dao 2023: its top for the forward, its bottom for the backward);
# memory-bound kernels, the datasheet bandwidth (1: no published sustained figure taken).
# Float8's dense peak (H100, H200 datasheets: 1,979 TFLOP/s) at the bf16 matmul share.
KERNELS = {
    "h100": dict(matmul_eff=792.1 / 989, attention_eff=333 / 989, attention_bwd_eff=318 / 989,
                 peak_fp8=1979e12),
    "h200": dict(matmul_eff=821.0 / 989, attention_eff=333 / 989, attention_bwd_eff=318 / 989,
                 peak_fp8=1979e12),
    "a100": dict(matmul_eff=267.9 / 312, attention_eff=0.73, attention_bwd_eff=0.50),
}


TABLE = {  # the dense peaks are `host.peaks.DENSE`'s (TFLOP/s), the one copy of those figures
    "h100": _gpu("h100", *(f / 1e12 for f in DENSE["h100"]), 80, 900, 50, 3350, **KERNELS["h100"]),
    "h200": _gpu("h200", *(f / 1e12 for f in DENSE["h200"]), 141, 900, 50, 4800, **KERNELS["h200"]),
    "a100": _gpu("a100", *(f / 1e12 for f in DENSE["a100"]), 80, 600, 25, 2039, **KERNELS["a100"]),
}
NAMES = (*TABLE, "cpu")
FIELDS = tuple(f.name for f in fields(DeviceSpec) if f.name not in ("name", "measured"))
# what a --cluster file's own device may leave out (0, or 1 for shared_slowdown and the kernels'
# shares: not counted)
OPTIONAL = ("cores", "shared_slowdown", "all_reduce_bw", "all_gather_bw", "reduce_scatter_bw", "coll_latency",
            "dtensor_step_s", "action_s", "runtime_step_s", "crowded_action_s", "tp_collective_s",
            "crowded_tp_collective_s", "peak_fp8", "matmul_eff", "attention_eff", "attention_bwd_eff",
            "mem_eff", "reserve_frac")


def device(name: str, reprobe: bool = False) -> DeviceSpec:
    """A built-in device by name ("cpu": this machine, probed once a day, `cpu`; `reprobe`: now).

    Raises:
        BrigadeError: an unknown name.
    """
    key = name.lower().replace(" ", "").replace("-", "")
    key = {"a10080gb": "a100", "h100sxm": "h100"}.get(key, key)
    if key == "cpu":
        return cpu(reprobe)
    if key not in TABLE:
        raise BrigadeError(
            f"--device {name!r}: unknown device: expected {', '.join(NAMES)}, or a "
            "--cluster FILE.toml with a [device] table"
        )
    return TABLE[key]


_PROBED: list[DeviceSpec] = []  # this process's probe, once measured or loaded
_SOURCES = [__file__, gloo_probe.__file__]  # the code that measures: kept probes are keyed on it


def cpu(reprobe: bool = False) -> DeviceSpec:
    """This machine: its probe from the last day, kept in the cache folder (`probe_cache`), or
    measured now (`probe`) and kept; `reprobe`: measured now whatever is kept. Once per process."""
    if reprobe or not _PROBED:
        spec = None if reprobe else probe_cache.load(DeviceSpec, _SOURCES)
        if spec is None:
            spec = probe()
            probe_cache.save(spec, _SOURCES)
        _PROBED[:] = [spec]
    return _PROBED[0]


def probe() -> DeviceSpec:
    """This machine, measured (about 20 s, most of it the shared-cores turns and gloo): see the
    module docstring."""
    import torch

    cores = os.cpu_count() or 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, fastest = matmul_seconds(1)
        half = half_matmul_seconds()
        alone, together = _shared_slowdown(min(cores, 8))
        gloo = gloo_probe.measure()
    finally:
        torch.set_num_threads(threads)
    flops = 2 * MATMUL_N**3 / fastest
    mem_bw = _copy_rate()
    bw, latency = gloo.pop("intra_bw"), gloo.pop("intra_latency")
    return DeviceSpec(
        "cpu",
        2 * MATMUL_N**3 / half,
        flops,
        host_memory(),
        bw,
        latency,
        bw,
        latency,
        mem_bw,
        cores,
        max(1.0, together / alone),
        measured=True,
        **gloo,
    )


_MATMULS = """
import statistics, sys, time, torch
torch.set_num_threads(1)
a = torch.randn(512, 512)
a @ a
print("ready", flush=True)
for line in sys.stdin:  # "go": time now (with the others, or while they wait); closed: exit
    times = []
    for _ in range(120):
        t0 = time.perf_counter()
        a @ a
        times.append(time.perf_counter() - t0)
    print(statistics.median(times[20:]), flush=True)
"""


def _shared_slowdown(n: int, pairs: int = 5) -> tuple[float, float]:
    """(median seconds of a 512² matmul in one process alone, the slowest process's median while
    `n` processes run them at once): processes, as a run's ranks are, each with its own
    interpreter (threads of one process would also contend for its interpreter's lock).

    The processes start once; then one of them alone and all of them together take turns,
    `pairs` times, and each figure is the median of its turns, so that a slow moment does not
    fall on one side only. (Measured once each, one after the other, the slowdown read 1.02 in
    one probe and 1.28 in another; in turns it still reads 1.04-1.30 here, the machine's own
    spread.)"""
    import subprocess
    import sys

    procs = [subprocess.Popen([sys.executable, "-c", _MATMULS], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(n)]

    def turn(k: int) -> list[float]:
        for p in procs[:k]:  # every process times at once, none while another still imports torch
            p.stdin.write("go\n")
            p.stdin.flush()
        return [float(p.stdout.readline()) for p in procs[:k]]

    try:
        for p in procs:
            p.stdout.readline()  # "ready": torch imported, its first matmul done
        turns = [(turn(1)[0], max(turn(n))) for _ in range(pairs)]
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=120)
    return statistics.median(a for a, _ in turns), statistics.median(t for _, t in turns)


def _copy_rate() -> float:
    """Bytes/s of a large tensor copy (read and write), the optimizer step's kind of work."""
    import torch

    x = torch.ones(8 * 2**20)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        y.copy_(x)
        best = min(best, time.perf_counter() - t0)
    return 2 * x.numel() * 4 / best


def host_memory() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0.0
