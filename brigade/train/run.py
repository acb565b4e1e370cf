"""`brigade train`: check everything up front, launch the workers, report where results are.

    run(cfg)     in the user's shell: preflight → config.toml → launch N workers (elastic agent)
    worker(cfg)  in each process (also what torchrun and srun start): data → model → Trainer
                 → resume from the newest good snapshot → fit → final snapshot → plot, sample
"""

from __future__ import annotations

import faulthandler
import math
import os
import random
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from brigade import forensics
from brigade.config import RunConfig, pipeline_shape, resolve_layout
from brigade.config.optimizer import resolve as resolve_update
from brigade.config.validate import logs
from brigade.errors import BrigadeError, RunError
from brigade.launcher import agent, groups
from brigade.launcher.env import launcher_env, launcher_world, under_launcher
from brigade.parallel import compiled, context, experts, lora, sequence, tensor
from brigade.pipeline.plans.schedule import SCHEDULES
from brigade.pipeline.stages.measured_cut import MEASURED
from brigade.pipeline.stages.partition import check_chain, choose_balance, parse_balance
from brigade.snapshot import collective
from brigade.snapshot.compat import check_compatible
from brigade.snapshot.format import SnapshotError, find_latest, read_manifest
from brigade.snapshot.rng import torch_rng_fingerprint
from brigade.train import metrics, mfu, report, trackers
from brigade.train.data import build, hf_data
from brigade.train.faults import Fault, FaultInjector
from brigade.train.snapshots import Snapshots
from brigade.train.supervise import launch_with_events, layout_record, this_round
from brigade.train.trainer import NonFiniteError, Trainer, sample_of

_IMPORTED = time.perf_counter()

def check_out(out: str) -> None:
    """--out must be a folder we can write; nothing in it is touched here."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise BrigadeError(f"--out {out!r} is a file: give a folder for the run's results")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise BrigadeError(f"--out {out!r} cannot be written ({exc.strerror}): choose a writable folder") \
            from None


def _prepare_out_and_data(cfg: RunConfig) -> None:
    """--out checked, then an hf:DIR model's data tokenized into it (its cache, OUT/tokens) once
    for every process; a folder this made is removed again when the data is refused."""
    existed = Path(cfg.train.out).exists()
    check_out(cfg.train.out)
    if cfg.model.model.startswith("hf:"):
        try:
            hf_data(cfg)
        except BaseException:
            if not existed:
                shutil.rmtree(cfg.train.out, ignore_errors=True)
            raise


def preflight(cfg: RunConfig, quiet: bool = False, launched: bool = False) -> None:
    """Every check that needs no process group: devices, data, model, layout, output folder.
    `quiet`: check, but leave the lines it prints (a damaged snapshot) to rank 0. `launched`: a
    launcher (torchrun, srun) started this process and met the nodes: no endpoint to check.

    Raises:
        BrigadeError: naming what is wrong; nothing has been written.
    """
    if cfg.train.tensorboard or "tensorboard" in logs(cfg.train.log):
        metrics.require_tensorboard()
    trackers.require(logs(cfg.train.log))
    # nccl without any GPU: refused here, one line
    p, (_, device) = cfg.parallel, groups.pick_backend(cfg.parallel.backend)
    if device == "cuda" and (gpus := torch.cuda.device_count()) < (need := p.nproc * p.local_stages):
        raise BrigadeError(f"--nproc {p.nproc} × --local-stages {p.local_stages} on {p.backend} needs {need} "
                           f"GPUs on this node but {gpus} are visible: use fewer, or --backend gloo")
    blocks, _, train, _, _, weights, _ = build(cfg, data=False)  # the workers' model, vocabulary real
    # A user's blocks may not fit each other: say so before any launch. (An hf:DIR model's
    # blocks, the family's own modules, have no memory here to run on: `brigade check` proves them.)
    if cfg.model.model != "gpt" and weights is None:
        check_chain(blocks, train.batch(torch.arange(2))[0])
    tensor.check_plans(blocks, p.tp, cfg.model.model)
    if (adapters := lora.spec_of(cfg.model, cfg.train.seed)) is not None:
        lora.targets(blocks, adapters)
        lora.check_with(p.float8)
    experts.check_model(blocks, p.ep, cfg.model.model)
    sequence.check_length(blocks, p.tp, cfg.data.block_size, p.sequence_parallel)
    context.check_model(blocks, p.cp, context.method_for(p.cp_method, device), p.tp, cfg.data.block_size,
                        cfg.model.model)
    ranks, virtual = pipeline_shape(p)
    given = parse_balance(p.balance) if p.balance and p.balance != MEASURED else None
    if p.balance == MEASURED and (ranks == 1 or not SCHEDULES[p.schedule].costed):
        where = "" if ranks > 1 else " without a pipeline"
        raise BrigadeError(f"--balance measured cuts the blocks for a costed schedule's plan (auto), not "
                           f"for --schedule {p.schedule}{where}: use --schedule auto with --pp or "
                           "--local-stages, or give the cut, like 3,3")
    choose_balance(blocks, ranks * virtual, balance=given)
    if p.nnodes > 1 and not launched:
        from brigade.host.net import node_address, parse_endpoint

        me = node_address(*parse_endpoint(p.rdzv_endpoint), p.local_addr)
        print(f"brigade: node {p.node_rank} of {p.nnodes} advertises {me.addr}"
              + (f" on {me.ifname}" if me.ifname else "") + f"; rendezvous at {p.rdzv_endpoint}", flush=True)
    _prepare_out_and_data(cfg)
    found = find_latest(cfg.train.out, warn=(lambda m: None) if quiet else
                        (lambda m: print(f"brigade: warning: {m}", flush=True)))
    if found is not None:
        check_compatible(found.manifest, cfg)


def resume(trainer: Trainer, cfg: RunConfig, data_sha: str | None = None) -> int:
    """Collective: load the newest good snapshot in --out into `trainer`, if any (model, optimizer,
    RNG, data cursor, fp16's loss scale); returns its step (0 if none). Where the token data
    (`data_sha`) is not the snapshot's, rank 0 says so: the run goes on at the same global
    position in the data it now has.

    Raises:
        SnapshotError: ranks see different snapshots, or it is of another configuration.
    """
    path = [None]
    if dist.get_rank() == 0:
        found = find_latest(cfg.train.out, warn=lambda m: print(f"brigade: warning: {m}", flush=True))
        path = [str(found.path) if found else None]
    dist.broadcast_object_list(path, src=0)
    if path[0] is None:
        return 0
    found = find_latest(cfg.train.out, warn=lambda m: None)
    if found is None or str(found.path) != path[0]:
        raise SnapshotError(f"rank {dist.get_rank()} sees other snapshots than rank 0 in "
                            f"{cfg.train.out}: the folder must be shared by every node")
    check_compatible(found.manifest, cfg)
    manifest = collective.load(found, trainer.model, trainer.optimizer, loss_scaler=trainer.scaler)
    if manifest.data and data_sha and manifest.data != data_sha and dist.get_rank() == 0:
        print(f"brigade: warning: the data changed since snapshot step {manifest.step} (token "
              f"shards {manifest.data[:12]} then, {data_sha[:12]} now): the run goes on at the same "
              "position in the new data, so its samples are not those it would have read", flush=True)
    trainer.state.step = manifest.step
    trainer.sampler.cursor = trainer.state.cursor = manifest.cursor
    return manifest.step


def _seconds_since_process_start() -> float:
    """Wall time since this process was created (Linux /proc), else since brigade was imported."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


def worker(cfg: RunConfig, fault: Fault | None = None) -> dict:
    """One process of a training run (under brigade's launcher, torchrun, or srun); its summary.

    Everything that holds a process group (the trainer, its DDP wrappers, the fault injector's
    hooks) lives inside `_train` and is gone when it returns; only then are the groups left
    (`groups.destroy` says why the order matters). Should leaving hang all the same, the
    faulthandler watchdog, a C thread that needs no GIL, prints every thread's stack and ends
    the process once `hang_timeout` has passed, instead of letting it hang at exit for ever.
    """
    info = groups.init(cfg.parallel.backend, cfg.parallel.threads,
                      forensics.group_timeout(cfg.parallel.hang_timeout), cfg.parallel.local_stages)
    summary = _train(this_round(cfg), info, fault)  # elastic: dp from the world this round formed
    faulthandler.dump_traceback_later(cfg.parallel.hang_timeout, exit=True)
    groups.destroy()
    faulthandler.cancel_dump_traceback_later()
    return summary


def _train(cfg: RunConfig, info, fault: Fault | None) -> dict:
    """Build, resume, fit and snapshot; the summary of this rank's run."""
    if cfg.parallel.compile:  # before anything compiles: a restart finds the first attempt's graphs
        compiled.use_cache(cfg.train.out)
    cfg = resumed_cut(cfg)
    blocks, loss_fn, train, val, vocab, weights, data_sha = build(cfg)
    # counted on the whole model, before the layout cuts and wraps it; on the rank that logs
    logs_mfu = info.rank == 0 and cfg.train.mfu
    utilization = _utilization(cfg, blocks, loss_fn, train, info) if logs_mfu else None
    trainer = Trainer(blocks, loss_fn, train, val, parallel=cfg.parallel, optim=cfg.optim,
                      train=cfg.train, weights=weights, adapters=lora.spec_of(cfg.model, cfg.train.seed))
    trainer.utilization = utilization
    injector = FaultInjector(fault, info.rank)
    agent.watch_signals()  # SIGTERM: finish this step, snapshot, leave
    injector.should_stop = agent.stop_requested
    resumed = resume(trainer, cfg, data_sha)
    layout = _announce(cfg, info, resumed)
    snaps = Snapshots(trainer, cfg, vocab.chars if vocab else None, info.device, injector.during_snapshot,
                      data_sha)
    injector.settled = snaps.landed
    trainer.before_step.append(injector.before_step)
    trainer.callbacks.append(_first_step(resumed))
    trainer.callbacks.append(snaps.after_step)
    injector.attach(trainer.model)
    with trainer.metrics:
        if layout:
            trainer.metrics.write(layout)
        history = _fit(trainer, cfg, snaps)
        final = snaps.final()
    summary = {"rank": info.rank, "step": trainer.state.step, "snapshot": str(final) if final else None,
               "preempted": trainer.stop_requested,
               "params_sha256": read_manifest(final).params_sha256 if final else None,
               "rng": {"torch": torch_rng_fingerprint(), "python": random.random()},
               "val_loss": next((r["val_loss"] for r in reversed(history) if "val_loss" in r), None)}
    trainer.close()
    return summary


def _utilization(cfg: RunConfig, blocks, loss_fn, train, info) -> mfu.Utilization | None:
    """What the log's MFU is held to (`train.mfu`), counted on the run's first sample; None, said
    in one line, where the device's peak is not known or the model does not run on the meta device."""
    try:
        got = mfu.utilization(cfg, blocks, loss_fn, sample_of(train), info.device, info.world_size)
    except Exception as exc:  # a model of the user's that needs real tensors: train on without MFU
        print(f"brigade: MFU left out of the log: the model's FLOPs could not be counted on the meta "
              f"device ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})", flush=True)
        return None
    if got is None:
        print(f"brigade: MFU left out of the log: {torch.cuda.get_device_name(info.device)}'s peak is not "
              "in the planner's table; --peak-tflops gives it", flush=True)
    return got


def resumed_cut(cfg: RunConfig) -> RunConfig:
    """`cfg` with the cut of the newest snapshot in --out, where the run measures its cut
    (--balance measured, `process_model.cut_of`) and the snapshot says which it was: measured again,
    the cut could differ, and with it each stage's dropout masks and the order of its sums, so a
    resumed run would not go on exactly as it would have."""
    p = cfg.parallel
    if p.balance != MEASURED:
        return cfg
    found = find_latest(cfg.train.out, warn=lambda m: None)
    saved = found.manifest.balance if found is not None else None
    if not saved or len(saved) != math.prod(pipeline_shape(p)):
        return cfg
    return replace(cfg, parallel=replace(p, balance=",".join(map(str, saved))))


def _announce(cfg: RunConfig, info, resumed: int) -> dict | None:
    """An elastic run's layout record; the resume and layout-change lines; metrics of the attempt
    that died dropped (after `layout_record` read them)."""
    layout, change = layout_record(cfg, resumed)
    if resumed and info.rank == 0:
        metrics.trim(cfg.train.out, resumed)
        print(f"brigade: resuming from snapshot step {resumed}", flush=True)
    if change and info.local_rank == 0:
        print(change, flush=True)
    return layout


def _first_step(resumed: int):
    """The trainer's callback that logs when this attempt's first step ended (a restart's cost)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def first_step(tr: Trainer, record: dict) -> None:
        if record.get("step") == resumed + 1 and "loss" in record:
            tr.metrics.write({"step": record["step"], "event": "first_step", "attempt": attempt,
                              "resumed_from": resumed,
                              "seconds_from_process_start": _seconds_since_process_start()})

    return first_step


def _fit(trainer: Trainer, cfg: RunConfig, snaps: Snapshots) -> list[dict]:
    """trainer.fit(); a non-finite loss or gradient norm ends the run, naming what to resume from.

    Raises:
        RunError: on every rank alike (the values checked are reduced over all ranks); nothing
            non-finite was applied to the parameters, nor snapshotted.
    """
    try:
        return trainer.fit()
    except NonFiniteError as exc:
        snaps.settle_quietly()  # a snapshot of a good step on its way: let it land first
        found = find_latest(cfg.train.out, warn=lambda m: None)
        where = (f"the newest good snapshot is step {found.manifest.step} in {found.path.parent}"
                 if found else f"there is no snapshot in {cfg.train.out} yet")
        raise RunError(f"the {exc.what} is {exc.value} at step {exc.step}; {where}: lower --lr (now "
                       f"{exc.lr:g}) or --grad-clip, or check the data, then run again") from None


def _launched(cfg: RunConfig, fault: Fault | None, world) -> dict[int, dict]:
    """This process was started by torchrun, srun or a `brigade.launch` of the user's: every rank
    checks what `preflight` checks (so a mistake stops each of them, not only one) and keeps its
    stderr under OUT/logs; global rank 0 also does what brigade's own parent would (`report`)."""
    env = launcher_env()
    rank = env.rank if env is not None else int(os.environ.get("RANK", "0"))
    preflight(cfg, quiet=rank != 0, launched=True)
    report.keep_stderr(report.stderr_log(cfg.train.out, rank))
    if rank == 0:
        report.start(cfg, world.size if world is not None else cfg.parallel.dp * cfg.parallel.pp)
    summary = worker(cfg, fault)
    if rank == 0:
        report.finish(cfg, summary)
    return {summary["rank"]: summary}


def with_update(cfg: RunConfig) -> RunConfig:
    """`cfg` with --adamw resolved for the run's device (`config.optimizer.resolve`): what its first
    line and config.toml name."""
    device_type = groups.pick_backend(cfg.parallel.backend)[1]
    return replace(cfg, optim=replace(cfg.optim, adamw=resolve_update(cfg.optim.adamw, device_type)))


def run(cfg: RunConfig, fault: Fault | None = None, port: int | None = None) -> dict[int, dict]:
    """What `brigade train` does in the user's shell. Returns this node's ranks' summaries.

    Under a launcher the launcher's world decides the layout (`config.resolve_layout`); `cfg`
    from `config.build(args, world=launcher_world())` already agrees with it.

    Raises:
        BrigadeError: the layout contradicts the world, or a preflight check fails.
        agent.Stopped: the launcher was sent a signal; the workers wrote a snapshot and left.
    """
    world = launcher_world()
    cfg = with_update(resolve_layout(cfg, world))
    if under_launcher():
        return _launched(cfg, fault, world)
    preflight(cfg)
    p = cfg.parallel
    cores = os.cpu_count() or 1
    if not torch.cuda.is_available() and p.nproc * p.threads > cores:
        print(f"brigade: warning: --nproc {p.nproc} × --threads {p.threads} is more than the {cores} "
              "CPU cores here; processes will share cores and each step will be slower", flush=True)
    if p.node_rank == 0:  # one writer for the shared folder
        nodes = f"{p.min_nodes} to {p.nnodes} nodes × {p.nproc}" if p.min_nodes else p.nproc * p.nnodes
        report.start(cfg, nodes)
    results = launch_with_events(worker, cfg, fault, port=port)
    if p.node_rank == 0:  # global rank 0 may live on another node under c10d rendezvous
        report.finish(cfg, results[min(results)])
    else:
        print(f"brigade: node {p.node_rank} done", flush=True)
    return results
