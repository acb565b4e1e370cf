"""A GPU's profile: what `scripts/gpu-check.sh` measures on a lent GPU, written as JSON, and what
the planner takes from it in place of the published shares (`devices.KERNELS`).

    python -m brigade.planner.profile --out gpu-profile.json     (CUDA; half a minute)

    matmul_flops     a bf16 matmul's FLOP/s at a big square shape (`MATMUL_N`), the median of
                     `REPEATS` timed runs after a warm-up: the device's `matmul_eff` is this ÷
                     its bf16 peak
    mem_bw           a big device-to-device copy's bytes/s (read and write, `COPY_BYTES`): the
                     device's `mem_eff` is this ÷ its `mem_bw`
    reserve_frac     after a few training steps of a small transformer (AdamW, bf16 autocast),
                     torch.cuda.max_memory_reserved ÷ max_memory_allocated − 1: the share the
                     caching allocator holds beyond what the tensors take (`planner.reserve`)
    device, torch    what it was measured on, for the reader

A --cluster file names it in its [device] table, relative to the file (`cluster.py`):

    [device]
    name = "h100"
    profile = "gpu-profile.json"

and its three figures set `matmul_eff`, `mem_eff` and `reserve_frac` (a field the table gives
itself wins).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from brigade.errors import BrigadeError
from brigade.planner.devices import DeviceSpec

KEYS = ("matmul_flops", "mem_bw", "reserve_frac")  # the figures the planner reads
MATMUL_N = 8192  # a matmul of 8192³: big enough to reach a GPU's sustained rate
COPY_BYTES = 2**30  # a copy of 1 GiB: far past any cache
REPEATS = 10


def read(path: Path) -> dict[str, float]:
    """The measured figures of a profile file (module docstring).

    Raises:
        BrigadeError: unreadable, not JSON, or a figure missing or not a number > 0 (reserve_frac ≥ 0).
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise BrigadeError(f"device.profile {path}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise BrigadeError(f"device.profile {path}: not JSON ({exc}): write it with "
                           "python -m brigade.planner.profile") from None
    out = {}
    for key in KEYS:
        v = data.get(key) if isinstance(data, dict) else None
        low = 0.0 if key == "reserve_frac" else 1e-300
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < low:
            raise BrigadeError(f"device.profile {path}: {key} = {v!r}: expected a number "
                               f"{'≥ 0' if low == 0 else '> 0'} (python -m brigade.planner.profile writes it)")
        out[key] = float(v)
    return out


def applied(spec: DeviceSpec, figures: dict[str, float], given: set[str]) -> DeviceSpec:
    """`spec` with a profile's figures as shares of its peaks (module docstring); the fields in
    `given` (set in the [device] table itself) are left as they are."""
    values = {"matmul_eff": figures["matmul_flops"] / spec.peak("bf16"),
              "mem_eff": figures["mem_bw"] / spec.mem_bw, "reserve_frac": figures["reserve_frac"]}
    return dataclasses.replace(spec, **{k: v for k, v in values.items() if k not in given})


def measure(device: str = "cuda") -> dict:
    """The profile of `device` (module docstring): the three figures, measured."""
    import torch

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(REPEATS):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    a = torch.randn(MATMUL_N, MATMUL_N, device=device, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    flops = 2 * MATMUL_N**3 / timed(lambda: a @ b)
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    bw = 2 * COPY_BYTES / timed(lambda: dst.copy_(src))  # read once, written once
    del a, b, src, dst
    return {"matmul_flops": flops, "mem_bw": bw, "reserve_frac": _reserve(device),
            "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "matmul_n": MATMUL_N, "copy_bytes": COPY_BYTES}


def _reserve(device: str, steps: int = 5) -> float:
    """Reserved over allocated, less one, at the peak of a few steps of a small transformer."""
    import torch

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    layer = torch.nn.TransformerEncoderLayer(2048, 16, 8192, batch_first=True, norm_first=True)
    model = torch.nn.TransformerEncoder(layer, 8, enable_nested_tensor=False).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(steps):
        x = torch.randn(8, 2048 - 128 * step, 2048, device=device)  # sizes vary, as a run's do
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_reserved(device) / torch.cuda.max_memory_allocated(device) - 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser("python -m brigade.planner.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu-profile.json", help="where the profile's JSON goes")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("no GPU visible to torch: a profile measures a CUDA device")
    figures = measure()
    Path(args.out).write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")
    print(f"matmul {figures['matmul_flops'] / 1e12:.0f} TFLOP/s, copy {figures['mem_bw'] / 1e9:.0f} GB/s, "
          f"reserve {figures['reserve_frac']:.1%} → {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
