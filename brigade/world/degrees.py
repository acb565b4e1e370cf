"""Every parallel degree of a run, checked in one place, and the one map between a rank and its
coordinates. No torch import: the configuration, the planner and `brigade check`'s refusals ask
it before any process starts; `world.mesh.World` builds the DeviceMesh from it.

A world's ranks form one grid, outermost dimension first:

    replicate × shard × pp × cp × tp       rank = (((replicate · S + shard) · P + pp) · C + cp) · T + tp

    dp 4, shard 2, pp 2:   rank = (replicate · 2 + shard) · 2 + pp           (cp = tp = 1)
    dp 2, pp 2, tp 2:      rank = (dp · 2 + pp) · 2 + tp

tp is innermost, so the processes that split one stage's matmuls are neighbours (one node: the
fastest links), then cp (context parallel: a stage's sequence split over processes), then pp;
the data-parallel processes of a stage are outermost. `dp` = replicate × shard, flattened: a
stage's dp rank is replicate · S + shard. Expert parallel adds no dimension: its groups are
carved out of dp, `ep` consecutive dp ranks each (the experts split over them, the dense
parameters keep their sharding over all of dp).

Context parallel (cp) splits each sequence of a stage over cp processes (`parallel.context`):
they hold the same weights, as data-parallel ones do, so their gradients are averaged over
"dpcp" (replicate × shard × cp: DDP's group under --cp) or sharded over shard × cp (FSDP2,
`world.mesh.World.data_mesh`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from brigade.errors import BrigadeError

DIMS = ("replicate", "shard", "pp", "cp", "tp")  # the mesh's dimensions, outermost first
# named groups over several dimensions: dp; under --cp, the processes that share a stage's weights
FLATTENED = {"dp": ("replicate", "shard"), "dpcp": ("replicate", "shard", "cp")}


@dataclass(frozen=True)
class Coords:
    """One rank's place: a coordinate per dimension, and its data-parallel rank (replicate · S +
    shard) and expert rank (its place among the `ep` dp ranks of its expert group)."""

    replicate: int = 0
    shard: int = 0
    pp: int = 0
    cp: int = 0
    tp: int = 0
    dp: int = 0
    ep: int = 0


@dataclass(frozen=True)
class Degrees:
    """How many processes each parallel dimension has; their product is the world.

    dp: the data-parallel processes of a stage (replicas × shards); shard: of those, how many
    shard its parameters between them (FSDP2; HSDP where dp > shard); pp: pipeline ranks; cp:
    context-parallel processes per stage; tp: tensor-parallel processes per stage; ep: experts'
    processes, carved out of dp.
    """

    dp: int = 1
    shard: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def replicate(self) -> int:
        return self.dp // self.shard

    @property
    def sharded(self) -> bool:
        """Whether a stage's replicas go under FSDP2: --shard, and tensor parallel with replicas
        or context-parallel processes (whose DTensor parameters DDP does not take, at --shard 1
        too). Its mixed precision, its gathered copies and its gradient buffers follow
        (`parallel.assemble`, `planner.memory`)."""
        return self.shard > 1 or (self.tp > 1 and self.dp * self.cp > 1)

    @property
    def fsdp(self) -> int:
        """The processes FSDP2 shards a stage's weights over where `sharded`: --shard, times cp
        (the context-parallel processes share the shards, as torchtitan has it)."""
        return self.shard * self.cp

    @property
    def size(self) -> int:
        """The processes of the whole world."""
        return self.dp * self.pp * self.cp * self.tp

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh's shape, in `DIMS` order."""
        return tuple(getattr(self, d) for d in DIMS)

    def check(self, world_size: int | None = None, where: str = "", hint: str = "") -> Degrees:
        """Refuse degrees that cannot make a world, in one line each; returns self.

        Args:
            world_size: the processes there are (None: any number).
            where: what set the world size, for the message (" (--nproc 4 × --nnodes 1)").
            hint: said after the fix of a world size that does not match (", or leave --dp out").

        Raises:
            BrigadeError: a degree below 1, --shard or --ep not dividing dp, or dp × pp × cp × tp
                other than the world size.
        """
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise BrigadeError(f"--{f.name} {getattr(self, f.name)}: must be ≥ 1")
        for name, what, none in (("shard", "replicas", "no sharding"), ("ep", "expert groups", "none")):
            n = getattr(self, name)
            if self.dp % n:
                raise BrigadeError(f"--{name} {n} does not divide the data-parallel width dp {self.dp}"
                                   f"{where}: give --{name} a divisor of {self.dp} (dp = --{name} × {what}; "
                                   f"1: {none})")
        if world_size is not None and self.size != world_size:
            used = [d for d in ("dp", "pp", "cp", "tp") if d in ("dp", "pp") or getattr(self, d) > 1]
            named = " × ".join(f"--{d} {getattr(self, d)}" for d in used)
            raise BrigadeError(f"{named} = {self.size} but the world size is {world_size}{where}: the world "
                               f"size must equal {' × '.join(used)}{hint}")
        return self

    @classmethod
    def derive(cls, world_size: int, dp: int = 0, where: str = "", hint: str = "", **others: int) -> Degrees:
        """The degrees of a world of `world_size` processes, dp = world ÷ (pp × cp × tp) when `dp`
        is 0; checked (`check`, `where` and `hint` as there).

        Raises:
            BrigadeError: a world that tp, or pp × cp × tp, does not divide, or as `check`.
        """
        probe = cls(**others)
        if probe.tp > 1 and world_size % probe.tp:
            raise BrigadeError(f"--tp {probe.tp} does not divide the world size {world_size}{where}: "
                               "make the world a multiple of --tp")
        cells = probe.pp * probe.cp * probe.tp  # the processes of one data-parallel replica
        if dp == 0:
            if world_size % cells:
                by = " × ".join(f"--{d} {getattr(probe, d)}" for d in ("pp", "cp", "tp")
                                if d == "pp" or getattr(probe, d) > 1)
                by += f" = {cells}" if cells != probe.pp else ""
                raise BrigadeError(f"world size {world_size}{where} is not divisible by {by}: make it a "
                                   "multiple of the pipeline stages" + (" × --tp" if probe.tp > 1 else ""))
            dp = world_size // cells
        return cls(dp=dp, **others).check(world_size, where, hint)

    def coords(self, rank: int) -> Coords:
        """`rank`'s coordinates (the grid in the module docstring)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a world of {self.size}")
        at: dict[str, int] = {}
        for d, n in reversed(list(zip(DIMS, self.shape))):
            rank, at[d] = divmod(rank, n)
        dp = at["replicate"] * self.shard + at["shard"]
        return Coords(**at, dp=dp, ep=dp % self.ep)

    def rank(self, **coords: int) -> int:
        """The rank at these coordinates (those not given: 0). `dp` may stand for replicate and
        shard together."""
        if "dp" in coords:
            coords["replicate"], coords["shard"] = divmod(coords.pop("dp"), self.shard)
        rank = 0
        for d, n in zip(DIMS, self.shape):
            c = coords.get(d, 0)
            if not 0 <= c < n:
                raise ValueError(f"{d} coordinate {c} is outside 0..{n - 1}")
            rank = rank * n + c
        return rank

    def group(self, dim: str, rank: int) -> list[int]:
        """The ranks of `rank`'s group along `dim` (a dimension, "dp", "dpcp", "ep" or "edp"), in
        coordinate order."""
        return next(line for line in self.groups(dim) if rank in line)

    def groups(self, dim: str) -> list[list[int]]:
        """Every group along `dim` (a dimension of `DIMS`, "dp": replicate and shard together,
        "ep": `ep` consecutive dp ranks, "edp": the dp ranks of one place in their expert
        groups, every ep-th, or "dpcp": dp and cp together), each its ranks in coordinate
        order; the groups in rank order of the other coordinates. Every rank must create process
        groups in this order."""
        if dim == "ep":
            return [line[i:i + self.ep] for line in self.groups("dp") for i in range(0, self.dp, self.ep)]
        if dim == "edp":
            return [line[i::self.ep] for line in self.groups("dp") for i in range(self.ep)]
        along = FLATTENED.get(dim, (dim,))
        if not set(along) <= set(DIMS):
            raise ValueError(f"unknown dimension {dim!r}: expected one of {', '.join(DIMS)}, dp, dpcp or ep")
        out: dict[tuple, list[int]] = {}
        for r in range(self.size):
            c = self.coords(r)
            rest = tuple(getattr(c, d) for d in DIMS if d not in along)
            out.setdefault(rest, []).append(r)
        return list(out.values())
