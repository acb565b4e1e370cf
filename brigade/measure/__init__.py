"""Measuring primitives: what the benchmarks, the tuner, the planner and the doctor time and
count on this machine. Low in the house: it imports nothing of planner/, bench/, results/, the CLI
or the doctor (tests/test_imports.py).

    timing       the synchronised clock, `measure`, interleaved rounds, the steps they time, ping-pong
    stats        medians over rounds and their distribution-free intervals, per-round ratios
    stages       per-stage and per-block forward, backward, weight and input seconds
    activations  a stage's peak memory: saved tensors on CPU, the allocator's peak on CUDA
    device       a bench process's model, batch and DDP wrapper on its device
    gloo_probe   this host's gloo: point to point, collectives, DTensor's step, the runtime's own time
"""
