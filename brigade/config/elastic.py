"""Elastic runs (--nnodes MIN:MAX): which worlds a run can reach, and its accumulation in each.

The pipeline depth pp is fixed; dp = world ÷ pp follows the nodes present. The global batch
is fixed too: --grad-accum is the accumulation at the largest world (MAX nodes) and grows as
nodes are lost, so a replica's chunk never grows and the optimizer sees the same batches.
`config.resolve_layout` calls these; no torch import. (The line for a rendezvous that
failed to meet MIN nodes is `brigade.launcher.rendezvous.rendezvous_failed`.)

Under brigade's launcher (`agent.launch` with min_nodes > 0) a lost node fails the others'
workers; their agents restart them (one of --max-restarts) once MIN nodes meet again, waiting
--rdzv-last-call seconds for more and --rdzv-timeout at most. A node that arrives makes the
agents stop their workers (SIGTERM: finish the step, snapshot, leave) and meet again with it;
torch's agent counts no restart for that.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from brigade.errors import BrigadeError

if TYPE_CHECKING:
    from brigade.config.launched import Launched
    from brigade.config.sections import ParallelConfig, RunConfig


def parse_nodes(text: str | int) -> tuple[int, int]:
    """``"2"`` → (2, 2); ``"1:2"`` → (1, 2), torchrun's elastic range.

    Raises:
        BrigadeError: not N or MIN:MAX with 1 ≤ MIN ≤ MAX.
    """
    parts = str(text).strip().split(":")
    if len(parts) > 2 or not all(x.strip().isdigit() for x in parts):
        raise BrigadeError(f"--nnodes {str(text)!r}: expected a number of machines like 2, or an elastic "
                           "range MIN:MAX like 1:2")
    lo, hi = int(parts[0]), int(parts[-1])
    if lo < 1 or lo > hi:
        raise BrigadeError(f"--nnodes {str(text)!r}: expected MIN:MAX with 1 ≤ MIN ≤ MAX, like 1:2")
    return lo, hi


def first_nodes(p: ParallelConfig) -> int:
    """The fewest nodes an elastic run trains on: MIN, or more where MIN nodes hold fewer
    processes than pp stages (the rendezvous then waits for more, up to --rdzv-timeout)."""
    return max(p.min_nodes, -(-p.pp // p.nproc))


def reachable(p: ParallelConfig) -> list[tuple[int, int]]:
    """(nodes, dp) for every node count the run can train on, fewest first.

    Raises:
        BrigadeError: a node count whose processes are not a multiple of pp.
    """
    out = []
    for n in range(first_nodes(p), p.nnodes + 1):
        if n * p.nproc % p.pp:
            raise BrigadeError(f"--nnodes {p.min_nodes}:{p.nnodes}: {n} nodes × --nproc {p.nproc} = "
                               f"{n * p.nproc} processes, not a multiple of --pp {p.pp}: use an --nproc "
                               "that is a multiple of --pp")
        out.append((n, n * p.nproc // p.pp))
    return out


def split_nnodes(given: dict) -> dict:
    """Typed flags with --nnodes N or MIN:MAX as nnodes (MAX) and min_nodes (MIN; 0: not elastic)."""
    if "nnodes" not in given:
        return given
    lo, hi = parse_nodes(given["nnodes"])
    return {**given, "nnodes": hi, "min_nodes": lo if lo < hi else 0}


def check_range(p: ParallelConfig, given: Collection[str], under_launcher: bool,
                check_batch: Callable[[int, int], None]) -> None:
    """No fixed --dp, enough processes for pp at MAX, (under brigade's own launcher, whose agent
    restarts the workers after a loss) --max-restarts ≥ 1, and `check_batch(nodes, dp)` passing
    at every node count the run can reach (`reachable`).

    Raises:
        BrigadeError: naming the flag to change.
    """
    rng = f"--nnodes {p.min_nodes}:{p.nnodes}"
    if "dp" in given and p.dp:
        raise BrigadeError(f"--dp {p.dp} with {rng}: leave --dp out, an elastic run's dp follows the nodes "
                           "present (world ÷ --pp)")
    if p.min_nodes > p.nnodes:
        raise BrigadeError(f"{rng}: MIN is more than MAX; give MIN:MAX with MIN ≤ MAX")
    if p.nproc * p.nnodes < p.pp:
        raise BrigadeError(f"{rng} × --nproc {p.nproc} gives at most {p.nproc * p.nnodes} processes, "
                           f"fewer than --pp {p.pp}: add nodes or processes")
    if not under_launcher and p.max_restarts < 1:
        raise BrigadeError(f"{rng} with --max-restarts 0: a lost node would end the run; set "
                           "--max-restarts to the number of node losses to survive (≥ 1)")
    for nodes, dp in reachable(p):
        check_batch(nodes, dp)


def launcher_nodes(p: ParallelConfig, world: Launched) -> tuple[int, int]:
    """(processes per node, MAX) for an elastic run under a launcher whose world is `world`.

    Raises:
        BrigadeError: the launcher's count of nodes is outside --nnodes MIN:MAX.
    """
    if world.local is None:  # the process group alone: no count of nodes to check
        return p.nproc, p.nnodes
    nodes = world.size // world.local
    if not p.min_nodes <= nodes <= p.nnodes or world.size % world.local:
        raise BrigadeError(f"--nnodes {p.min_nodes}:{p.nnodes} but {world.launcher} started {world.size} "
                           f"processes, {world.local} per node: give brigade the launcher's --nnodes range")
    return world.local, p.nnodes


def accumulation(cfg: RunConfig, dp: int) -> int:
    """Gradient accumulation at `dp` replicas: --grad-accum at MAX nodes, scaled by dp_max ÷ dp
    (rounded up to a divisor of the batch) below it. Not elastic: --grad-accum.

    Raises:
        BrigadeError: the global batch cannot be kept at `dp`.
    """
    p, b, k = cfg.parallel, cfg.train.batch_size, cfg.optim.grad_accum
    if not p.min_nodes:
        return k
    dp_max = p.nproc * p.nnodes // p.pp
    least = -(-k * dp_max // dp)
    for a in range(least, b // dp + 1):
        if b % (dp * a) == 0:
            return a
    need = math.lcm(*(d * -(-k * dp_max // d) for _, d in reachable(p)))
    raise BrigadeError(f"--batch-size {b} cannot be kept on {dp * p.pp // p.nproc} node(s): it does not "
                       f"split over dp {dp} × at least {least} accumulation steps; use a multiple of {need}")
