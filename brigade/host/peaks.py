"""What this machine's devices can do at their peak, in FLOP/s: the dense figures of the GPUs
brigade knows (vendors' datasheets), and one CPU core's matmul rate, measured.

    H100 SXM    989 TFLOP/s bf16 dense, 67 fp32 (no TF32)
    H200 SXM    989 / 67 TFLOP/s
    A100 80 GB  312 TFLOP/s bf16 dense, 19.5 fp32

(NVIDIA's H100, H200 and A100 datasheets.) The planner's device table (`planner.devices`) takes
its peaks from `DENSE`, and its probe of this machine times the same matmuls (`matmul_seconds`,
`half_matmul_seconds`); a run's MFU is held to `gpu_peak` or `core_peak` (`train.mfu`). torch is
imported only when a matmul is timed.
"""

from __future__ import annotations

import threading
import time

DENSE = {"h100": (989e12, 67e12), "h200": (989e12, 67e12), "a100": (312e12, 19.5e12)}  # (bf16, fp32)
MATMUL_N = 256  # the timed square matmul: a few milliseconds on one core


def _half(precision: str) -> bool:
    return precision in ("bf16", "fp16")


def gpu_peak(name: str, precision: str = "") -> float | None:
    """The dense peak of the GPU a CUDA device's name names ("NVIDIA H100 80GB HBM3": h100) for
    `precision` ("bf16", "fp16" or fp32), or None for a GPU not in `DENSE`."""
    squashed = name.lower().replace(" ", "").replace("-", "")
    key = next((k for k in DENSE if k in squashed), None)
    return None if key is None else DENSE[key][0 if _half(precision) else 1]


def core_peak(precision: str = "") -> float:
    """One CPU core's matmul rate for `precision`, measured now: the fastest of three turns of
    `matmul_seconds` (or `half_matmul_seconds`), a new process's first matmuls running far below
    the core's rate. A few tenths of a second."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    timed = half_matmul_seconds if _half(precision) else lambda: matmul_seconds(1)[1]
    try:
        seconds = min(timed() for _ in range(3))
    finally:
        torch.set_num_threads(threads)
    return 2 * MATMUL_N**3 / seconds


def matmul_seconds(n_threads: int, repeats: int = 30) -> tuple[float, float]:
    """(median, fastest) seconds of one fp32 matmul while `n_threads` threads each run them (torch
    frees the GIL); the fastest gives the peak, medians the slowdown."""
    import statistics

    import torch

    a = [torch.randn(MATMUL_N, MATMUL_N) for _ in range(n_threads)]
    times: list[list[float]] = [[] for _ in range(n_threads)]

    def run(k: int) -> None:
        for _ in range(repeats):
            t0 = time.perf_counter()
            a[k] @ a[k]
            times[k].append(time.perf_counter() - t0)

    workers = [threading.Thread(target=run, args=(k,)) for k in range(n_threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    got = [t for ts in times for t in ts[2:]]
    return statistics.median(got), min(got)


def half_matmul_seconds(repeats: int = 6) -> float:
    """The fastest of a few bf16 matmuls of the same size (a CPU without bf16 units takes tens of
    times an fp32 one)."""
    import torch

    a = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ a
        times.append(time.perf_counter() - t0)
    return min(times[1:])
