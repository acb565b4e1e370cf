"""`brigade bench`: sizes for the device at hand, the workers, bench.json, plots, a table."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from pathlib import Path

import torch
from torch import nn

from brigade.bench import plot
from brigade.bench.cases import BenchConfig, scaled_splits
from brigade.bench.experiments import worker
from brigade.bench.figures import summarise
from brigade.errors import BrigadeError
from brigade.host import malloc
from brigade.launcher import agent
from brigade.launcher.rendezvous import LaunchSpec
from brigade.models import load_model
from brigade.models.gpt import GPTConfig
from brigade.pipeline.batches import microbatch
from brigade.pipeline.plans import schedule
from brigade.pipeline.stages import structure
from brigade.pipeline.stages.partition import check_chain
from brigade.pipeline.stages.side_inputs import needed


def bench_config(args: argparse.Namespace) -> BenchConfig:
    """The tutorial's sizes on GPUs; on CPU, sizes that fit 10 minutes (2 with --quick)."""
    gpu = torch.cuda.device_count() >= 2
    # NCCL needs a GPU per process: with fewer than 2, both processes run on the CPU (gloo).
    cfg = BenchConfig(model=args.model, backend="nccl" if gpu else "gloo")
    if args.model == "resnet50":
        size = args.image_size or (128 if gpu else 64)
        cfg.model_options = {"image_size": size}
        cfg.batch_size = args.batch_size or (120 if gpu else 32)
    elif args.model == "gpt":
        cfg.model_options = {"gpt_cfg": GPTConfig(vocab_size=96, block_size=128, n_layer=8, n_head=4,
                                                  n_embd=256)}
        cfg.batch_size = args.batch_size or 32
    else:
        cfg.batch_size = args.batch_size or 32
    if args.model.startswith("hf:"):  # torch's pipelining hands a stage one tensor: no side inputs
        cfg.model_options = {"standalone": True, "block_size": 128}
    cfg.repeats = args.repeats or (10 if gpu else 2 if args.quick else 5)  # the tuner's
    # bench: as many interleaved rounds with --quick (fewer configurations instead, below); 10
    # gives a 95 % CI of the median from the 2nd to the 9th value.
    cfg.rounds = args.repeats or 10
    cfg.warmup = 1
    cfg.compile = getattr(args, "compile", False)
    if args.splits:
        try:
            cfg.splits = [int(s) for s in args.splits.split(",")]
        except ValueError:
            raise BrigadeError(f"--splits {args.splits!r}: expected sizes like 1,4,16") from None
    elif args.quick:  # one split size, m = 8: where every torch schedule runs at p = 2
        cfg.splits = [max(1, cfg.batch_size // 8)]
    cfg.schedules = [s.strip() for s in args.schedules.split(",")]
    cfg.ranks = getattr(args, "ranks", 2)
    if cfg.ranks < 2 or (gpu and cfg.ranks > torch.cuda.device_count()):
        most = f", and at most {torch.cuda.device_count()} (this machine's GPUs)" if gpu else ""
        raise BrigadeError(f"--ranks {cfg.ranks}: expected at least 2 pipeline ranks{most}")
    for s in cfg.schedules:
        schedule.check(s, "--schedules")
    if cfg.batch_size < 2 or any(not 1 <= s <= cfg.batch_size for s in cfg.splits):
        raise BrigadeError(f"split sizes must be between 1 and the batch size ({cfg.batch_size})")
    return cfg


def check_timeable(spec, command: str) -> None:
    """bench and tune time models of plain tensors: refuse a structured batch, side inputs, or
    a block anywhere in the chain that returns a structure (`check_chain` probes every block's
    output). Their probes and torch.distributed.pipelining's stages take one tensor per stage.

    Raises:
        BrigadeError: naming the model (and the block) and what to use instead.
    """
    x = spec.make_batch(2, torch.Generator().manual_seed(0))[0]
    if not torch.is_tensor(x) or needed(spec.blocks):
        what = "takes side inputs" if needed(spec.blocks) else f"takes a {type(x).__name__} batch"
        raise BrigadeError(f"{spec.name} {what}: brigade {command} times models whose batch is one "
                           "tensor; check it with brigade check and train it with brigade train")
    outputs = check_chain(spec.blocks, x)
    i = next((i for i, out in enumerate(outputs) if out != structure.TENSOR), None)
    if i is not None:
        raise BrigadeError(f"{spec.name}: block {i} ({type(spec.blocks[i]).__name__}) returns a "
                           f"{outputs[i].kind}: brigade {command} times models whose blocks pass one "
                           "tensor; check it with brigade check and train it with brigade train")


def check_batch_norm(spec, cfg: BenchConfig, command: str, ranks: int) -> None:
    """Refuse sizes that would give a BatchNorm layer one sample: in training it needs two to
    take a variance, and would fail inside a worker ("Expected more than 1 value per channel").
    The smallest batches a rank steps on are data parallel's share (the batch over `ranks`) and
    the last micro-batch of each split size.

    Raises:
        BrigadeError: naming the size and what to give instead.
    """
    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for b in spec.blocks for m in b.modules()):
        return
    b = cfg.batch_size
    chunks = torch.arange(b).chunk(ranks)  # as data parallel's rows share the batch
    share = min(len(c) for c in chunks) if len(chunks) == ranks else 0
    if share < 2:
        raise BrigadeError(f"{spec.name} has BatchNorm, which needs 2 samples a batch: batch {b} over "
                           f"{ranks} ranks leaves a data-parallel rank {share}; give --batch-size "
                           f"{2 * ranks} or more")
    for s in cfg.splits or scaled_splits(b):
        least = min(microbatch.sizes(b, math.ceil(b / s)))
        if least < 2:
            fine = next(k for k in range(2, b + 1) if min(microbatch.sizes(b, math.ceil(b / k))) >= 2)
            raise BrigadeError(f"{spec.name} has BatchNorm, which needs 2 samples a batch: split size {s} "
                               f"of batch {b} gives micro-batches of {least}; give brigade {command} "
                               f"--splits sizes of {fine} or more")


def run_bench(args: argparse.Namespace) -> int:
    cfg = bench_config(args)
    spec = load_model(cfg.model, seed=cfg.seed, **cfg.model_options)
    check_timeable(spec, "bench")
    check_batch_norm(spec, cfg, "bench", cfg.ranks)
    if len(spec.blocks) < cfg.ranks:
        raise BrigadeError(f"{cfg.model} has {len(spec.blocks)} block(s): bench --ranks {cfg.ranks} needs "
                           f"at least {cfg.ranks} to split")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise BrigadeError(f"--out {args.out!r} is a file: give a folder")
    cores = os.cpu_count() or 1
    device = f"{cfg.ranks} GPUs" if torch.cuda.device_count() >= 2 else \
        f"{cfg.ranks} CPU processes × 1 thread" + (f" on {cores} cores" if cfg.ranks > cores else "")
    print(f"brigade bench: {cfg.model}{', compiled' if cfg.compile else ''}, batch {cfg.batch_size}, "
          f"split sizes {cfg.splits or 'the tutorial’s, scaled'}, {cfg.rounds} interleaved rounds, "
          f"on {device}", flush=True)
    start = time.perf_counter()
    with _malloc_defaults(getattr(args, "malloc_defaults", False)):
        raw = agent.launch(worker, LaunchSpec(cfg.ranks, port=args.port), cfg)[0]
    data = summarise(cfg, raw, device)
    data["wall_s"] = time.perf_counter() - start
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".bench.json.tmp"
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(out / "bench.json")
    pngs = plot.write_all(data, out)
    print(plot.table(data))
    for line in plot.cut_lines(data):
        print(line)
    print(best_line(data["best"]))
    if data["ci_coverage"] < data["confidence"]:
        print(f"note: with {cfg.rounds} rounds the intervals cover {100 * data['ci_coverage']:.0f} %, "
              f"not {100 * data['confidence']:.0f} %: give --repeats 6 or more to rank with confidence")
    print(f"wrote {out / 'bench.json'}, " + ", ".join(p.name for p in pngs)
          + f", timeline_trace.json in {data['wall_s']:.0f} s")
    return 0


@contextlib.contextmanager
def _malloc_defaults(on: bool):
    """Workers started inside leave malloc as it is (`on`), instead of keeping freed memory."""
    if not on:
        yield
        return
    before = os.environ.get(malloc.ENV)
    os.environ[malloc.ENV] = "0"  # read by each worker as it joins the group (brigade.host.malloc)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(malloc.ENV)
        else:
            os.environ[malloc.ENV] = before


def best_line(best: dict | None) -> str:
    """One line on brigade's best against torch's best, or why the bench cannot rank them."""
    if best is None:
        return "no brigade or no torch pipeline was timed: nothing to rank"
    ours, theirs = (plot.label(best[k]) for k in ("brigade", "torch"))
    lo, hi = best["vs_torch_ci"]
    ratio = f"×{best['vs_torch']:.2f} (95 % CI {lo:.2f}–{hi:.2f}, per-round ratios)"
    if not best["vs_torch_ranked"]:
        return (f"cannot rank: best brigade ({ours}) vs torch.distributed.pipelining's best ({theirs}) "
                f"is {ratio}: the spread is too large, or the rounds too few, to tell which is faster"
                + _bound_clause(best))
    line = f"best brigade pipeline ({ours}) is {ratio} torch.distributed.pipelining's best ({theirs})"
    return line + _bound_clause(best)


def _bound_clause(best: dict) -> str:
    """How much faster than torch's best any plan could be, from the bounds, when measured."""
    if "bound_vs_torch" not in best:
        return ""
    return (f"; no plan over these cuts could beat it by more than ×{best['bound_vs_torch']:.3f}, "
            f"nor over any cut by more than ×{best['balanced_bound_vs_torch']:.3f} (transfers free)")


def run_tune(args: argparse.Namespace) -> int:
    from brigade.bench.tune import worker as tune_worker
    from brigade.config import to_toml
    from brigade.fsutil import write_atomic
    from brigade.planner.budget import parse_bytes, size_text
    from brigade.planner.sweep import label

    cfg = bench_config(args)
    cfg.memory_per_device = parse_bytes(args.memory_per_device)
    spec = load_model(cfg.model, seed=cfg.seed, **cfg.model_options)
    check_timeable(spec, "tune")
    check_batch_norm(spec, cfg, "tune", 2)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise BrigadeError(f"--out {args.out!r} is a file: give a folder")
    before = os.getloadavg()[0]
    result = agent.launch(tune_worker, LaunchSpec(2, port=args.port), cfg, args.verify)[0]
    result["load_avg"] = [before, os.getloadavg()[0]]  # 1-minute, as the tune started and ended
    chosen = result["chosen"]
    out.mkdir(parents=True, exist_ok=True)
    toml = out / "tune.toml"
    write_atomic(toml, to_toml(_train_config(cfg, chosen)))
    write_atomic(out / "tune.json", json.dumps(result, indent=1))
    result["config_file"] = str(toml)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k not in ("predictions", "sweep")}))
        return 0
    again = f", {result['finalists']} finalists timed again" if result["finalists"] else ""
    print(f"brigade tune: {cfg.model}{', compiled' if cfg.compile else ''}, batch {cfg.batch_size}: "
          f"{result['trials']} trials{again} "
          f"(the full sweep has {result['sweep_trials']}: schedule × V × m, and data parallel)")
    for gone in result["left_out"]:
        print(f"left out: {gone['schedule']}, V={gone['virtual']}: {gone['reason']}")
    if result["too_big"]:
        print(f"left out, predicted above --memory-per-device {size_text(cfg.memory_per_device)}: " +
              "; ".join(f"{label(r)} {size_text(r['predicted_peak_bytes'])}" for r in result["too_big"]))
    cut = "" if chosen["balance"] is None else \
        f" (split size {math.ceil(cfg.batch_size / chosen['microbatches'])}), balance {chosen['balance']}"
    print(f"chosen: {label(chosen)}{cut}: {chosen['mean_s'] * 1e3:.1f} ms/step "
          f"(predicted {chosen['predicted_s'] * 1e3:.1f})")
    if args.verify:
        lo, hi = (100 * w for w in result["within_ci"])
        best, cover = result["sweep_best"], 100 * result["within_ci_coverage"]
        print(f"full sweep best: {label(best)}: {best['mean_s'] * 1e3:.1f} ms/step; the choice, timed "
              f"again in the sweep, {result['chosen_sweep_mean_s'] * 1e3:.1f} ms/step: within "
              f"{100 * result['within']:+.1f} % of it ({cover:.0f} % CI of the per-round ratio: "
              f"{lo:+.1f} to {hi:+.1f} %)")
    note = load_note(result["load_avg"], os.cpu_count() or 1)
    if note:
        print(note)
    print(f"wrote {toml} (brigade train --config {toml}) and {out / 'tune.json'}")
    return 0


def load_note(load_avg: list[float], cpus: int) -> str | None:
    """A line when other jobs loaded the machine while tuning (the tuner's own processes count
    up to one per core; more than a core beyond that is someone else's), or None.

    Under such load a step's time swings by more than the gaps between configurations (on 2
    cores at a load of 7, one configuration read 1.3 s to 5.8 s over ten rounds): the choice
    among close configurations is then contention's, and --verify's interval shows it.
    """
    worst = max(load_avg)
    if worst <= cpus + 1:
        return None
    return (f"note: the 1-minute load average reached {worst:.1f} on {cpus} cores while tuning: other "
            "jobs' contention can decide between configurations this close; --verify's interval "
            "says whether it did, a quiet machine decides")


def _train_config(cfg: BenchConfig, chosen: dict):
    """The train config of the configuration `tune` chose: a pipeline (schedule, V, m, balance)
    over pp processes, or data parallel (pp = 1) over dp."""
    from brigade.config import RunConfig

    run = RunConfig()
    run.model.model = cfg.model
    if cfg.model == "gpt":
        g = cfg.model_options["gpt_cfg"]
        run.model.n_layer, run.model.n_head, run.model.n_embd = g.n_layer, g.n_head, g.n_embd
        run.model.tie_embeddings = g.tie_embeddings
        run.model.context = run.data.block_size = g.block_size
    p = run.parallel
    p.nproc, p.pp, p.dp = chosen["dp"] * chosen["pp"], chosen["pp"], chosen["dp"]
    if chosen["pp"] > 1:
        p.schedule, p.virtual = chosen["schedule"], chosen["virtual"]
        p.microbatches = chosen["microbatches"]
        p.balance = ",".join(map(str, chosen["balance"]))
    else:
        p.microbatches = 1  # no pipeline: each replica steps on its whole share of the batch
    p.compile = cfg.compile  # timed compiled: train it compiled
    run.train.batch_size = cfg.batch_size
    return run
