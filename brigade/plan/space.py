"""The layouts a cluster can run a model in: dp = replicate × shard, pp, V and schedule (every
schedule of the registry, so one added later is covered), micro-batches and recompute.

A layout is valid when dp × pp is the world, shard divides dp, the model has the p·V stages'
blocks, and each replica's share of the batch divides into its micro-batches.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from brigade.errors import BrigadeError
from brigade.pipeline.plans.schedule import DEFAULT, DEFAULT_VIRTUAL, SCHEDULES

ANY_VIRTUAL = (1, DEFAULT_VIRTUAL)  # V tried for a schedule that takes any


@dataclass(frozen=True)
class Layout:
    """One way to run: `replicate` × `shard` data-parallel ranks (dp), each a pipeline of `pp`
    ranks holding `virtual` stages each, `microbatches` per replica's batch, `recompute` mode."""

    replicate: int
    shard: int
    pp: int
    schedule: str
    virtual: int
    microbatches: int
    recompute: str

    @property
    def dp(self) -> int:
        return self.replicate * self.shard

    @property
    def world(self) -> int:
        return self.dp * self.pp

    def label(self) -> str:
        dp = (
            ("" if self.dp == 1 and self.pp > 1 else f"dp {self.dp}")
            if self.shard == 1
            else (f"shard {self.shard}" if self.replicate == 1 else f"HSDP {self.replicate}×{self.shard}")
        )
        pipe = (
            f"{' × ' if dp else ''}pp {self.pp} {self.schedule}"
            + (f" V{self.virtual}" if self.virtual > 1 else "")
            if self.pp > 1
            else ""
        )
        rc = f", recompute {self.recompute}" if self.recompute != "none" else ""
        return f"{dp}{pipe}, m {self.microbatches}{rc}"

    def to_json(self) -> dict:
        return {**asdict(self), "dp": self.dp}


def check(layout: Layout, world: int, n_blocks: int, batch: int) -> None:
    """Refuse a layout that cannot divide the world, the model or the batch.

    Raises:
        BrigadeError: one line naming what does not divide and how to fix it.
    """
    if layout.world != world:
        raise BrigadeError(
            f"dp {layout.dp} × pp {layout.pp} = {layout.world} ranks, but the cluster has "
            f"{world}: choose dp × pp = {world}"
        )
    if layout.dp % layout.shard:
        raise BrigadeError(f"--shard {layout.shard} does not divide dp {layout.dp}: give a divisor of it")
    stages = layout.pp * layout.virtual
    if stages > n_blocks:
        raise BrigadeError(
            f"pp {layout.pp} × V {layout.virtual} = {stages} stages, but the model has "
            f"{n_blocks} blocks: use fewer stages or a deeper model"
        )
    if batch % layout.dp or (batch // layout.dp) % layout.microbatches:
        raise BrigadeError(
            f"batch {batch} does not divide into dp {layout.dp} replicas of "
            f"{layout.microbatches} micro-batches: give a batch that is a multiple of "
            f"{layout.dp * layout.microbatches}"
        )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(
    world: int,
    n_blocks: int,
    batch: int,
    recompute: list[str],
    schedules: list[str] | None = None,
    microbatches: list[int] | None = None,
) -> list[Layout]:
    """Every valid layout (module docstring) for `world` ranks; `schedules` default: the registry's,
    `microbatches` default: powers of two up to 4 · pp (never more than a replica's batch). Without
    a pipeline the schedule is the default one: it does not matter."""
    out = []
    for pp in divisors(world):
        dp = world // pp
        for shard in divisors(dp):
            for name in (schedules or list(SCHEDULES)) if pp > 1 else [DEFAULT]:
                fixed = SCHEDULES[name].virtual
                for v in ((fixed,) if fixed else ANY_VIRTUAL) if pp > 1 else (1,):
                    if pp * v > n_blocks:
                        continue
                    for m in microbatches or _powers(4 * pp):
                        for mode in recompute:
                            layout = Layout(dp // shard, shard, pp, name, v, m, mode)
                            if batch % dp == 0 and (batch // dp) % m == 0:
                                out.append(layout)
    return out


def _powers(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]
