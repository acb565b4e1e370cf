"""The measuring primitives' GPU path, checked on CPU: clocks read after a device sync, the
allocator's peak on CUDA, models, batches and DDP on the process's device (that the benchmarks use
NCCL only with a GPU per process: tests/bench/test_bench.py)."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from brigade.measure import activations, stages, timing
from brigade.measure import device as measure_device
from brigade.models import load_model

CUDA = torch.device("cuda", 1)


@pytest.fixture
def events(monkeypatch):
    """Every device sync and every clock read in brigade.measure.timing, in order."""
    log = []
    clock = iter(range(10**6))
    monkeypatch.setattr(timing, "_sync", lambda device: log.append(("sync", device)))
    fake_time = SimpleNamespace(perf_counter=lambda: log.append("clock") or next(clock))
    monkeypatch.setattr(timing, "time", fake_time)
    return log


def _each_clock_follows_a_sync(log, device):
    clocks = [k for k, e in enumerate(log) if e == "clock"]
    assert clocks, log
    assert all(k > 0 and log[k - 1] == ("sync", device) for k in clocks), log


def test_stage_costs_synchronise_before_every_clock_read(events):
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    fwd, bwd, wgt, ing = stages.stage_costs(block, torch.randn(4, 8), repeats=2)
    _each_clock_follows_a_sync(events, torch.device("cpu"))
    # 2 × (repeats + 2) passes, alternately forward + backward (3 reads) and forward + weight (4 reads)
    assert events.count("clock") == 4 * 3 + 4 * 4
    assert fwd > 0 and bwd > 0 and wgt > 0 and ing > 0


def test_measure_synchronises_before_every_clock_read(events):
    done = []
    result = timing.measure(lambda: done.append(1), repeats=3, warmup=1, device=CUDA)
    _each_clock_follows_a_sync(events, CUDA)
    assert events.count("clock") == 6 and len(done) == 4 and result.samples == [1, 1, 1]


def test_block_costs_are_timed_through_the_synchronised_clock(events):
    blocks = [nn.Linear(8, 8), nn.Linear(8, 2)]
    costs = stages.block_costs(blocks, torch.randn(4, 8), nn.functional.mse_loss, torch.randn(4, 2))
    assert len(costs) == 2
    _each_clock_follows_a_sync(events, torch.device("cpu"))


def test_a_cuda_sync_waits_for_that_device(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    timing._sync(CUDA)
    timing._sync(torch.device("cpu"))
    timing._sync(None)
    assert waited == [CUDA]


def test_a_distributed_measure_needs_the_process_device():
    with pytest.raises(ValueError, match="needs device="):
        timing.measure(lambda: None, repeats=1, warmup=0, distributed=True)


def test_the_cpu_meter_counts_saved_tensors():
    model = nn.Linear(16, 16)
    meter = activations.stage_meter(torch.device("cpu"), exclude=list(model.parameters()))
    assert isinstance(meter, activations.ActivationMeter) and meter.method == "saved-tensors"
    with meter:
        torch.tanh(model(torch.randn(4, 16))).sum().backward()
    assert meter.peak_bytes > 0


def test_the_cuda_meter_reads_the_allocator_peak_above_the_start(monkeypatch):
    calls = []
    allocated = {"now": 1000, "peak": 1000}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync", device)))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: calls.append(("reset", device)) or allocated.update(peak=1000))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocated["peak"])
    allocated["peak"] = 99_999  # an earlier step's peak: reset on entry, not counted
    meter = activations.stage_meter(CUDA)
    assert meter.method == "allocator"
    with meter:
        allocated["peak"] = 5000  # the step
    assert meter.peak_bytes == 4000
    assert calls == [("sync", CUDA), ("reset", CUDA), ("sync", CUDA)]


def test_a_model_and_its_batch_go_to_the_process_device():
    spec = load_model("toy", seed=0)
    x, y = measure_device.place_model(spec, 4, 0, torch.device("meta"))
    assert x.device.type == y.device.type == "meta" and x.shape[0] == 4
    assert {p.device.type for b in spec.blocks for p in b.parameters()} == {"meta"}


@pytest.mark.parametrize("device,ids", [(CUDA, [CUDA]), (torch.device("cpu"), None)])
def test_ddp_is_placed_and_told_its_device(monkeypatch, device, ids):
    made = {}
    monkeypatch.setattr(measure_device, "DistributedDataParallel",
                        lambda m, device_ids: made.update(ids=device_ids) or m)

    class Module(nn.Module):
        def to(self, d):
            made["to"] = d
            return self

    measure_device.ddp(Module(), device)
    assert made == {"to": device, "ids": ids}
