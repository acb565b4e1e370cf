"""This host's gloo between two of its processes, measured for the "cpu" device (`planner.devices.cpu`):

    point to point   bandwidth and latency one way (send/recv of 16 MiB and of 4 bytes)
    collectives      all-reduce, all-gather and reduce-scatter of a 256 KiB and a 16 MiB buffer,
                     fitted to the ring formulas `planner.comm` prices them with: each kind's
                     bandwidth (bytes moved ÷ seconds, from the two sizes' difference) and one
                     latency per ring step. gloo copies and reduces on the same cores that
                     compute, so its collectives run far below its point-to-point bandwidth
                     (2 processes here: all-reduce ~0.8, all-gather ~0.6, reduce-scatter ~0.3
                     GB/s against ~2 GB/s point to point), and pricing them at the latter
                     predicted sharded data parallel 30 % fast
    as issued        what DDP and FSDP2 (one unit per layer), as the stage assembler wraps a stage
                     (`parallel.assemble`), add to a forward and backward of 4 linear layers of
                     1024 (16.8 MB of gradients), timed in turn with the plain step: the rates as
                     training issues them, bucket copies and hooks included (`as_issued`; but
                     FSDP2's own copies and hooks, timed on a fake world first and priced by the
                     planner apart, `planner.shard_costs`). Priced at the bare all-reduce's
                     rate, DDP's reduction read 1.3-1.7 × too fast
    DTensor step     what AdamW's step adds per parameter when the parameters are DTensors (a
                     sharded or tensor-parallel stage's are): each of its ops dispatches
                     through DTensor, a fixed cost per parameter that plain tensors do not pay
    runtime          brigade's own pipeline runtime (`pipeline.pipe.Pipeline`): two stages of
                     almost nothing stepped at m = 2 and m = 8 under 1F1B, fitted to a time per
                     action on the critical path (its dispatch and its transfer's handling) and
                     one per step (sharing the loss, setting up). On the GPT of the accuracy
                     benchmark, a pipeline of two at m = 4 ran 12-15 % above its predicted
                     compute until these were counted. The two steps are timed in turn, 24
                     times each after 3 warm-ups: timed one after the other, 8 times each, a slow
                     moment during one of them read as 0.4 ms an action in one probe and 1.0 ms in
                     the next, and the pipelines' predictions swung by as much as 40 %
    tensor parallel  two GPT blocks (128 wide, 32 positions, 4 samples) split over the two
                     processes with sequence parallel, as training splits them
                     (`parallel.assemble.split_blocks`), a forward and backward timed on a fake
                     world first (`world.mesh.fake_world`: its collectives free), then
                     on gloo, and on gloo again with every core busy (below): the difference
                     over the collectives the step issues is what one adds where DTensor
                     issues it among the compute (`tensor_parallel`). A bare all-gather or
                     reduce-scatter of those bytes took 0.8-1.3 ms here, one inside the blocks'
                     step 1-2 ms: its partner arrives late by whatever its own dispatch took
    crowded runtime  the same two steps timed again (12 times each) while as many more processes
                     as the host has cores compute: a rank woken by its neighbour's transfer
                     waits for a core until a running process's time slice ends, so an action
                     costs more where more processes compute than there are cores

Each other figure is a median of 8 timings after 2 warm-ups, on rank 0.
"""

from __future__ import annotations

import json
import subprocess
import sys

from brigade.errors import BrigadeError
from brigade.host.net import free_port

_PROBE = """
import json, os, statistics, sys, time, torch, torch.distributed as dist
r, port = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)

import copy
from brigade.models.gpt import GPTConfig, gpt
from brigade.parallel.assemble import split_blocks
from brigade.measure.collectives import Collectives
from brigade.world.mesh import fake_world
torch.manual_seed(0)
tp_blocks = gpt(GPTConfig(n_layer=2, n_embd=128, n_head=4, block_size=32))[1:-1]
def tp_step(mesh, rounds):  # two GPT blocks on one of 2 tp processes, sequence parallel
    blocks = copy.deepcopy(tp_blocks)
    split_blocks(blocks, [0, 1], mesh, "none")
    x = torch.randn(4, 16, 128, requires_grad=True)  # this process's part of 32 positions
    times = []
    for k in range(3 + rounds):
        if dist.get_backend() == "gloo":
            dist.barrier()
        start = time.perf_counter()
        blocks[1](blocks[0](x)).sum().backward()
        times.append(time.perf_counter() - start)
    with Collectives() as counted:
        blocks[1](blocks[0](x)).sum().backward()
    return statistics.median(times[3:]), counted.n
torch.manual_seed(0)
layers = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])  # 16.8 MB of grads
batch = torch.randn(8, 1024)
from brigade.planner.shard_costs import measure_shard
with fake_world(2) as fake:  # the collectives free, before this process joins the real world
    tp_fake, tp_count = tp_step(fake, 24)
    fsdp_own = sum(measure_shard(list(layers), batch, None, None, None, fake, 12))  # FSDP2's copies, hooks

dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)

def timed(fn):
    times = []
    for k in range(10):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])

def p2p(t):
    for sender in (0, 1):
        (dist.send if r == sender else dist.recv)(t, 1 - r)

got = {"p2p": [timed(lambda: p2p(torch.zeros(n))) / 2 for n in (1, 1 << 22)]}
for n in (1 << 16, 1 << 22):  # elements of the whole buffer: 256 KiB and 16 MiB
    x, half = torch.ones(n), torch.ones(n // 2)
    out = torch.empty(n)
    got.setdefault("all_reduce", []).append(timed(lambda: dist.all_reduce(x)))
    got.setdefault("all_gather", []).append(timed(lambda: dist.all_gather_into_tensor(out, half)))
    got.setdefault("reduce_scatter", []).append(timed(lambda: dist.reduce_scatter_tensor(half, x)))

from torch.distributed.tensor import Shard, distribute_tensor
from brigade.parallel.assemble import Cut, assemble
from brigade.world.degrees import Degrees
from brigade.world.mesh import World
cpu = torch.device("cpu")
sharding, replicas, pipeline = (World(d, cpu) for d in (Degrees(dp=2, shard=2), Degrees(dp=2), Degrees(pp=2)))
mesh = sharding.shard_mesh
from brigade.config.optimizer import flags, resolve
def step(params):  # AdamW as the trainer runs it by default (--adamw auto)
    opt = torch.optim.AdamW(params, **flags(resolve("auto", "cpu")))
    for p in params:
        p.grad = torch.zeros_like(p)
    return timed(opt.step)
k = 32
plain = step([torch.zeros(64, requires_grad=True) for _ in range(k)])
spread = step([torch.nn.Parameter(distribute_tensor(torch.zeros(128), mesh, [Shard(0)])) for _ in range(k)])
got["dtensor_step_s"] = max(0.0, (spread - plain) / k)

import copy
def wrapped_as_trained(world):  # the stage assembler's DDP or FSDP2, as `brigade train` wraps a stage
    return assemble(list(copy.deepcopy(layers)), Cut((4,), (0,)), world).stages[0]
plain, wrapped, sharded = copy.deepcopy(layers), wrapped_as_trained(replicas), wrapped_as_trained(sharding)
issued = {"plain": [], "ddp": [], "fsdp": []}
for k in range(3 + 12):  # in turn, so that a slow moment slows all three
    for name, module in (("plain", plain), ("ddp", wrapped), ("fsdp", sharded)):
        dist.barrier()
        start = time.perf_counter()
        module(batch).sum().backward()
        issued[name].append(time.perf_counter() - start)
        module.zero_grad(set_to_none=True)
got["issued"] = {name: statistics.median(ts[3:]) for name, ts in issued.items()}
got["issued"]["fsdp_own"] = fsdp_own
got["issued_bytes"] = sum(p.numel() * p.element_size() for p in layers.parameters())

two = assemble([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)], Cut((1, 1), (0, 1)), pipeline)
pipes = {m: (two.pipeline("1f1b", m, torch.nn.functional.mse_loss), torch.randn(4 * m, 8),
             torch.randn(4 * m, 8)) for m in (2, 8)}  # steps of two stages of almost nothing
def stepped(rounds):
    steps = {m: [] for m in pipes}
    for k in range(3 + rounds):  # the two in turn, so that a slow moment slows both
        for m, (pipe, x, y) in pipes.items():
            dist.barrier()
            start = time.perf_counter()
            pipe.step(x, y)
            steps[m].append(time.perf_counter() - start)
    return [statistics.median(steps[m][3:]) for m in pipes]
got["pipeline"] = stepped(24)
tp_mesh = World(Degrees(tp=2), cpu).tp_mesh
got["tp"] = [tp_fake, tp_step(tp_mesh, 24)[0], tp_count]
import subprocess
# each computes for at most a minute: one left behind by a probe that died stops by itself
SPIN = ("import time, torch; torch.set_num_threads(1); a = torch.randn(256, 256); print(flush=True)\\n"
        "end = time.monotonic() + 60\\nwhile time.monotonic() < end: a @ a")
spinners = []
try:
    if r == 0:  # as many more computing processes as cores: more processes than cores compute
        spinners = [subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE, text=True)
                    for _ in range(os.cpu_count() or 1)]
        for s in spinners:
            s.stdout.readline()  # ready: computing from now on
    got["crowded"] = stepped(12)
    got["tp_crowded"] = tp_step(tp_mesh, 24)[0]
finally:
    for s in spinners:
        s.kill()
        s.wait()
if r == 0:
    print(json.dumps(got), flush=True)
dist.barrier()
# out without tearing gloo down: once in tens of probes its teardown aborted the process after
# the figures were taken ("terminate called without an active exception")
os._exit(0)
"""
_SIZES = (4 << 16, 4 << 22)  # the collectives' whole buffers, bytes
_PIPELINE_M = (2, 8)  # the micro-batches of the runtime's two timed steps (the probe's m)


def measure() -> dict[str, float]:
    """The `DeviceSpec` fields of this host's gloo (module docstring): intra_bw, intra_latency,
    all_reduce_bw, all_gather_bw, reduce_scatter_bw, coll_latency, dtensor_step_s, action_s,
    runtime_step_s, crowded_action_s, tp_collective_s, crowded_tp_collective_s.

    Raises:
        BrigadeError: the probe's processes failed (naming the last line they wrote).
    """
    got = _run()
    (small, big) = got["p2p"]
    out = {"intra_bw": 4 * (1 << 22) / max(big - small, 1e-9), "intra_latency": small}
    # at n = 2 a ring all-reduce moves the whole buffer in 2 steps, the others half of it in 1
    lats = []
    for kind, share, steps in (("all_reduce", 1.0, 2), ("all_gather", 0.5, 1), ("reduce_scatter", 0.5, 1)):
        bw, lat = fit_rates(got[kind], [share * s for s in _SIZES], steps)
        out[f"{kind}_bw"] = bw
        lats.append(lat)
    out["coll_latency"] = sorted(lats)[1]
    out.update(as_issued(out, got["issued"], got["issued_bytes"]))
    out["dtensor_step_s"] = got["dtensor_step_s"]
    out["action_s"], out["runtime_step_s"] = runtime(got["pipeline"])
    out["crowded_action_s"] = max(out["action_s"], runtime(got["crowded"])[0])
    out.update(tensor_parallel(*got["tp"], got["tp_crowded"]))
    return out


def as_issued(fitted: dict[str, float], seconds: dict[str, float], grads: float) -> dict[str, float]:
    """The collectives' bandwidths as training issues them: what DDP (`parallel.replicate.data_parallel`)
    and FSDP2 (`parallel.shard.shard_stage`, 4 units) add to a forward and backward of 4 linear
    layers (`grads` bytes of gradients) over the plain step, priced as `_reduction` prices them
    (DDP: one all-reduce of `grads`; FSDP, one stage without a pipeline: per unit a
    reduce-scatter of its quarter and two all-gathers, for its forward and again for its
    backward), at `fitted`'s latency. A bare collective's rate misses their bucket copies, hooks
    and DTensor handling: DDP added 1.3–1.7 × a bare all-reduce of its bytes here. FSDP2's own
    work, timed with its collectives free (`seconds["fsdp_own"]`, `planner.shard_costs`), is
    priced apart by the planner and left out here. Where noise leaves nothing added, or less than
    a bare collective takes, the bare rates stand."""
    lat, out = fitted["coll_latency"], {}
    ddp = seconds["ddp"] - seconds["plain"] - 2 * lat  # at n = 2: bytes ÷ bw + 2 steps
    if ddp > 0 and grads / ddp < fitted["all_reduce_bw"]:
        out["all_reduce_bw"] = grads / ddp
    fsdp = seconds["fsdp"] - seconds["plain"] - seconds.get("fsdp_own", 0.0)
    fsdp -= 4 * 3 * lat  # 4 units, each a RS and 2 AGs of 1 step
    bare = grads / 2 / fitted["reduce_scatter_bw"] + 2 * grads / 2 / fitted["all_gather_bw"]
    if fsdp > bare:  # both slowed alike: the step cannot tell them apart
        out["reduce_scatter_bw"] = fitted["reduce_scatter_bw"] * bare / fsdp
        out["all_gather_bw"] = fitted["all_gather_bw"] * bare / fsdp
    return out


def tensor_parallel(fake: float, real: float, count: int, crowded: float) -> dict[str, float]:
    """`tp_collective_s` and `crowded_tp_collective_s`: what each of the `count` collectives of a
    tensor-parallel step added to it, from the step's seconds on a fake world (`fake`: the
    collectives free), on the real one (`real`) and on the real one with every core busy
    (`crowded`). Noise below the fake step reads as 0; crowded is never below uncrowded."""
    each = max(0.0, (real - fake) / max(count, 1))
    return {"tp_collective_s": each, "crowded_tp_collective_s": max(each, (crowded - fake) / max(count, 1))}


def runtime(seconds: list[float]) -> tuple[float, float]:
    """(seconds per action, seconds per step) of the runtime's own work, from the steps of a
    two-stage 1F1B pipeline of almost nothing at m = 2 and m = 8: its actions on the critical
    path (simulate's makespan at unit costs: 6 and 18) cost the first figure each, the rest of
    the step (the loss shared, the step's set-up) the second; negatives (noise) are read as 0."""
    from brigade.pipeline.plans.schedule import build
    from brigade.pipeline.plans.simulate import simulate

    path = [simulate(build("1f1b", 2, m), 1.0, 1.0).makespan for m in _PIPELINE_M]
    per = max(0.0, (seconds[1] - seconds[0]) / (path[1] - path[0]))
    return per, max(0.0, seconds[0] - per * path[0])


def fit_rates(seconds: list[float], moved: list[float], steps: int) -> tuple[float, float]:
    """(bytes/s, seconds per step) of `seconds` = steps · latency + moved / bandwidth, through
    two points; a negative latency (noise) is read as 0."""
    bw = (moved[1] - moved[0]) / max(seconds[1] - seconds[0], 1e-9)
    return bw, max(0.0, (seconds[0] - moved[0] / bw) / steps)


def _run() -> dict:
    # Below the kernel's ephemeral range (`free_port`): a port it picked (45875, once) was taken by
    # a neighbouring test's connection before the probe's store listened, and the probe waited
    # out its 300 s.
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, "-c", _PROBE, str(r), str(port)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    if any(p.returncode for p in procs):
        raise BrigadeError(
            "the cpu device's gloo probe failed: "
            f"{(outs[0][1] or outs[1][1]).strip().splitlines()[-1:]}; give the device "
            "in a --cluster file instead"
        )
    return json.loads(outs[0][0])
