"""The layouts a cluster can run a model in: dp = replicate × shard, pp, cp, tp, V and schedule
(every schedule of the registry, so one added later is covered), micro-batches and recompute, and
for a mixture of experts ep (expert groups carved out of dp: every divisor of dp that divides each
MoE layer's experts; 1 alone for a dense model).

A layout is valid when dp × pp × cp × tp is the world, shard divides dp, tp is a degree the
model's plans allow and divides a node's devices (tp innermost: its all-reduces stay inside a
node), cp is a degree the model's attention and sequence take at that tp (`attention.cp_sizes`:
powers of two up to a node's devices ÷ tp; 1 alone for a model without attention) and, as the
runtime has it, cp > 1 only at ep 1, the model has the p·V stages' blocks, and each replica's
share of the batch divides into its micro-batches (cp splits sequences, not the batch).

The tuner's sweep (`search_space`) is the pipelines of its ranks alone, at the micro-batch counts it
measures, with the (schedule, V) its model cannot take left out and why. Both try the same V per
schedule (`virtuals`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from brigade.errors import BrigadeError
from brigade.pipeline.plans.schedule import DEFAULT, DEFAULT_VIRTUAL, SCHEDULES
from brigade.world.degrees import Degrees


@dataclass(frozen=True)
class Layout:
    """One way to run: `replicate` × `shard` data-parallel ranks (dp), each a pipeline of `pp`
    ranks holding `virtual` stages each, each stage's sequences split over `cp` processes and its
    matmuls over `tp`, `microbatches` per replica's batch, `recompute` mode; a mixture's experts
    split over expert groups of `ep` of the dp ranks."""

    replicate: int
    shard: int
    pp: int
    schedule: str
    virtual: int
    microbatches: int
    recompute: str
    tp: int = 1
    ep: int = 1
    cp: int = 1

    @property
    def dp(self) -> int:
        return self.replicate * self.shard

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def degrees(self) -> Degrees:
        """The world's degrees this layout runs on."""
        return Degrees(dp=self.dp, shard=self.shard, pp=self.pp, cp=self.cp, tp=self.tp, ep=self.ep)

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
        cp = f"{' × ' if dp or pipe else ''}cp {self.cp}" if self.cp > 1 else ""
        tp = f"{' × ' if dp or pipe or cp else ''}tp {self.tp}" if self.tp > 1 else ""
        ep = f", ep {self.ep}" if self.ep > 1 else ""  # carved out of dp: no factor of the world
        return f"{dp}{pipe}{cp}{tp}{ep}, m {self.microbatches}{rc}"

    def to_json(self) -> dict:
        return {**asdict(self), "dp": self.dp}


def check(layout: Layout, world: int, n_blocks: int, batch: int) -> None:
    """Refuse a layout that cannot divide the world, the model or the batch.

    Raises:
        BrigadeError: one line naming what does not divide and how to fix it.
    """
    if layout.world != world:
        cp = f" × cp {layout.cp}" if layout.cp > 1 else ""
        tp = f" × tp {layout.tp}" if layout.tp > 1 else ""
        raise BrigadeError(
            f"dp {layout.dp} × pp {layout.pp}{cp}{tp} = {layout.world} ranks, but the cluster has "
            f"{world}: choose dp × pp{' × cp' if cp else ''}{' × tp' if tp else ''} = {world}"
        )
    if layout.dp % layout.shard:
        raise BrigadeError(f"--shard {layout.shard} does not divide dp {layout.dp}: give a divisor of it")
    if layout.dp % layout.ep:
        raise BrigadeError(f"--ep {layout.ep} does not divide dp {layout.dp}: expert groups are carved "
                           "out of the data-parallel ranks; give a divisor of it")
    if layout.cp > 1 and layout.ep > 1:
        raise BrigadeError(f"cp {layout.cp} with ep {layout.ep}: context parallel does not compose with "
                           "expert parallel yet; use one of them")
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


def virtuals(schedule: str) -> tuple[int, ...]:
    """The V tried for `schedule`: its fixed V, or, where it takes any, 1 and the default
    (`DEFAULT_VIRTUAL`, 2; more would need ≥ 3·p blocks), never past the most it runs."""
    return SCHEDULES[schedule].virtuals(DEFAULT_VIRTUAL)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(
    world: int,
    n_blocks: int,
    batch: int,
    recompute: list[str],
    schedules: list[str] | None = None,
    microbatches: list[int] | None = None,
    tp_sizes: tuple[int, ...] = (1,),
    per_node: int = 0,
    experts: tuple[int, ...] = (),
    cp_sizes: dict[int, tuple[int, ...]] | None = None,
) -> list[Layout]:
    """Every valid layout (module docstring) for `world` ranks; `schedules` default: the registry's,
    `microbatches` default: powers of two up to 4 · pp (never more than a replica's batch), `tp_sizes`:
    the degrees the model's plans allow, each kept to those that divide `per_node` (0: any);
    `experts`: every MoE layer's expert count (none: a dense model, ep 1 alone); `cp_sizes`: per tp
    degree, the cp degrees the model takes there (`AttentionFacts.cp_sizes`; a tp not in it, or
    None: cp 1 alone), each kept to those that divide world ÷ tp. Without a pipeline the schedule is
    the default one: it does not matter."""
    out = []
    for tp in tp_sizes:
        if world % tp or (per_node and per_node % tp):
            continue
        for cp in (cp_sizes or {}).get(tp, (1,)):
            if (world // tp) % cp:
                continue
            out += _layouts(world // (tp * cp), n_blocks, batch, recompute, schedules, microbatches, tp,
                            experts if cp == 1 else (), cp)  # cp > 1 at ep 1 alone (module docstring)
    return out


def ep_sizes(dp: int, experts: tuple[int, ...]) -> list[int]:
    """The ep degrees a dp of `dp` takes: its divisors that divide every layer's `experts` (1 alone
    without experts)."""
    return [e for e in divisors(dp) if all(n % e == 0 for n in experts)] if experts else [1]


def _layouts(cells: int, n_blocks: int, batch: int, recompute: list[str], schedules: list[str] | None,
             microbatches: list[int] | None, tp: int, experts: tuple[int, ...] = (),
             cp: int = 1) -> list[Layout]:
    """`enumerate_layouts` at one tp and cp degree, over the `cells` = world ÷ (cp × tp) (dp × pp)
    positions."""
    out = []
    for pp in divisors(cells):
        dp = cells // pp
        for shard in divisors(dp):
            for name in (schedules or list(SCHEDULES)) if pp > 1 else [DEFAULT]:
                for v in virtuals(name) if pp > 1 else (1,):
                    if pp * v > n_blocks:
                        continue
                    for m in microbatches or _powers(4 * pp):
                        if batch % dp or (batch // dp) % m:
                            continue
                        out += [Layout(dp // shard, shard, pp, name, v, m, mode, tp, ep, cp)
                                for ep in ep_sizes(dp, experts) for mode in recompute]
    return out


def _powers(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]


def search_space(schedules: list[str], ms: list[int], ranks: int,
                 n_blocks: int) -> tuple[list[dict], list[dict]]:
    """The pipelined configurations to predict, and the (schedule, V) left out with why.

    Args:
        schedules: registry names. ms: micro-batch counts. ranks: pipeline ranks (p).
        n_blocks: the model's blocks; p·V stages need as many.

    Returns:
        (rows with schedule, virtual, microbatches, dp = 1, pp = ranks; left_out rows with a reason).
    """
    rows, left_out = [], []
    for name in schedules:
        for v in virtuals(name):
            if n_blocks < ranks * v:
                left_out.append({"schedule": name, "virtual": v, "reason":
                                 f"the model has {n_blocks} blocks: {ranks * v} stages (p={ranks} × V={v}) "
                                 f"need as many"})
                continue
            rows += [{"schedule": name, "virtual": v, "microbatches": m, "dp": 1, "pp": ranks} for m in ms]
    return rows, left_out
