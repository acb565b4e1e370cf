"""The layout, derived once: data-parallel replicas from the world a launcher (or brigade) starts."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from brigade.config import elastic
from brigade.config.launched import Launched
from brigade.config.sections import ParallelConfig, RunConfig
from brigade.errors import BrigadeError
from brigade.world.degrees import Degrees


def pipeline_shape(p: ParallelConfig) -> tuple[int, int]:
    """(pipeline ranks, stages per rank) of a layout: the one place that says how many pieces the
    model is cut into (their product). Ranks are --pp processes, or --local-stages devices in one
    process; stages per rank come from --virtual and the schedule. (1, 1) without a pipeline.

    Raises:
        PlanError: an unknown schedule, or a --virtual it cannot run.
    """
    from brigade.pipeline.plans import schedule  # the registry owns each schedule's V

    ranks = p.pp * p.local_stages
    virtual = schedule.SCHEDULES[schedule.check(p.schedule)].resolve_virtual(p.virtual)
    return (ranks, virtual) if ranks > 1 else (1, 1)


def degrees_of(p: ParallelConfig) -> Degrees:
    """The parallel degrees of a resolved layout (dp set): what `world.World` builds its mesh from.
    Local stages are devices inside one process, not a degree of the world."""
    return Degrees(dp=p.dp, shard=p.shard, pp=p.pp, cp=p.cp, tp=p.tp, ep=p.ep)


def resolve_layout(cfg: RunConfig, world: Launched | None = None, given: Collection[str] = ()) -> RunConfig:
    """The one place the layout is derived: dp = world ÷ (pp × cp × tp) when --dp is 0. Pure.

    Local stages live inside one process, so they do not divide the world. Under a launcher
    the world is the launcher's; `--nproc` and `--nnodes` then only need to agree with it if
    the user gave them (`given`: field names typed or in the TOML file). An elastic range
    (--nnodes MIN:MAX) is checked at every node count it can reach (`elastic.check_range`).

    Returns:
        a copy of `cfg` with `dp` set and, under a launcher, `nproc` / `nnodes` the launcher's.

    Raises:
        BrigadeError: the world is not divisible by --pp, dp × pp ≠ world, a given --nproc or
            --nnodes that the launcher contradicts, or a batch that does not split over dp
            (at some reachable node count, for an elastic range).
    """
    p = cfg.parallel
    nproc, nnodes, size = p.nproc, p.nnodes, p.nproc * p.nnodes
    where = f"--nproc {p.nproc} × --nnodes {p.nnodes}"
    if world is not None:
        (nproc, nnodes), size = _launcher_nodes(p, world, given), world.size
        where = f"set by {world.launcher}"
    by = (" ÷ --cp" if p.cp > 1 else "") + (" ÷ --tp" if p.tp > 1 else "")
    hint = "" if world is None else f", or leave --dp out to derive it ({size} ÷ --pp{by})"
    # --shard is checked with the batch (below), at every node count an elastic range reaches.
    dp = Degrees.derive(size, dp=p.dp, pp=p.pp, cp=p.cp, tp=p.tp, ep=p.ep, where=f" ({where})", hint=hint).dp
    out = dataclasses.replace(cfg, parallel=dataclasses.replace(p, dp=dp, nproc=nproc, nnodes=nnodes))
    if p.min_nodes:  # every node count the range can reach
        elastic.check_range(out.parallel, given, world is not None, lambda n, d: _check_batch(out, d, n))
    _check_batch(out, dp)
    return out


def _launcher_nodes(p: ParallelConfig, world: Launched, given: Collection[str]) -> tuple[int, int]:
    """(processes on this node, nodes) as the launcher started them; a given flag must agree."""
    local = world.local or world.size
    if "nproc" in given and p.nproc != local:
        raise BrigadeError(f"--nproc {p.nproc} but {world.launcher} started {local} processes on this node: "
                           f"leave --nproc out under {world.launcher}, or have it start {p.nproc} per node")
    if p.min_nodes:  # elastic: nodes stays MAX, the launcher's count must lie in the range
        return elastic.launcher_nodes(p, world)
    nnodes = world.size // local if world.size % local == 0 else p.nnodes
    if "nnodes" in given and p.nnodes != nnodes:
        raise BrigadeError(f"--nnodes {p.nnodes} but {world.launcher} started {world.size} processes, "
                           f"{local} per node: leave --nnodes out under {world.launcher}")
    return local, nnodes


def _check_batch(cfg: RunConfig, dp: int, nodes: int = 0) -> None:
    """The global batch must split evenly over replicas and accumulation, then micro-batches; the
    replicas into shard groups of --shard."""
    p, t, k = cfg.parallel, cfg.train, elastic.accumulation(cfg, dp)
    Degrees(dp=dp, shard=p.shard, ep=p.ep).check(where=f" on {nodes} node(s)" if nodes else "")
    if t.batch_size % (dp * k):
        raise BrigadeError(f"--batch-size {t.batch_size} does not split evenly over dp {dp} × grad-accum "
                           f"{k}: use a multiple of {dp * k}")
    per_replica, where = t.batch_size // (dp * k), f" on {nodes} node(s)" if nodes else ""
    if p.pp * p.local_stages > 1 and p.microbatches > per_replica:
        raise BrigadeError(f"--microbatches {p.microbatches} is larger than each replica's batch "
                           f"({per_replica}{where}): use at most {per_replica} or a larger --batch-size")


