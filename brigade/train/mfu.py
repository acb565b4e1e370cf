"""Model FLOPs utilisation (MFU) in the training log: the model's FLOPs in a step over the
step's time and what the devices could do at their peak.

    mfu = FLOPs per sample × samples per step ÷ (step seconds × peak per device × devices)

FLOPs per sample are counted once, at the start, as the planner counts them (`models.flops`:
torch's FLOP counter, an MoE's grouped matmuls included, over the forward and backward of the
whole model, its weights' meta stand-ins, on a sample of the run's own data), so they are the
model's whatever the layout: recompute, a pipeline's bubble, communication and padding are not
FLOPs of the model, and lower the MFU, as they should. The peak per device is --peak-tflops
where given; else an H100's, H200's or A100's dense figure (`host.peaks`, which the planner's
device table reads too), bf16 under --precision bf16 or fp16 and fp32 otherwise; or, on a CPU,
one core's matmul rate measured at the start (× --threads). Another GPU has none, and the log
leaves MFU out. On a CPU the processes share the cores, so with more processes than cores MFU
falls as they wait for one.

Each training record gets `mfu` (a fraction) and `tflops` (what each device achieved, TFLOP/s);
the console prints MFU beside tokens/s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from brigade.config import RunConfig


@dataclass(frozen=True)
class Utilization:
    """What a run's steps are held to: the model's FLOPs in one step, the peak of one device,
    and how many devices the run has."""

    flops_per_step: float
    peak_per_device: float
    devices: int

    def of(self, seconds: float) -> dict:
        """The record's figures for a step of `seconds`."""
        achieved = self.flops_per_step / seconds / self.devices
        return {"mfu": achieved / self.peak_per_device, "tflops": achieved / 1e12}


def peak_per_device(cfg: RunConfig, device: torch.device) -> float | None:
    """FLOP/s of one device at its peak for this run's precision (module docstring), or None."""
    from brigade.host import peaks

    if cfg.train.peak_tflops > 0:
        return cfg.train.peak_tflops * 1e12
    precision = cfg.train.precision or ("bf16" if cfg.train.bf16 and device.type == "cuda" else "")
    if device.type == "cuda":
        return peaks.gpu_peak(torch.cuda.get_device_name(device), precision)
    return peaks.core_peak(precision) * cfg.parallel.threads


def flops_per_sample(blocks, loss_fn, sample) -> float:
    """The model's forward and backward FLOPs per sample of a batch (x, y) of its data, counted on
    the meta device (`models.flops.model_flops`): the run's own blocks, before any layout wraps
    them, on meta stand-ins of their weights."""
    from brigade.models.flops import model_flops
    from brigade.pipeline.batches import microbatch
    from brigade.pipeline.batches.feed import to
    from brigade.pipeline.batches.sample import runnable

    x, y = (to(t, "meta") for t in sample)
    h, bound = runnable(blocks, x)
    return model_flops(bound, h, y, loss_fn) / microbatch.batch_size_of(h)


def utilization(cfg: RunConfig, blocks, loss_fn, sample, device: torch.device,
                devices: int) -> Utilization | None:
    """What the run's MFU is held to, or None where the device's peak is not known."""
    peak = peak_per_device(cfg, device)
    if peak is None:
        return None
    return Utilization(flops_per_sample(blocks, loss_fn, sample) * cfg.train.batch_size, peak, devices)
