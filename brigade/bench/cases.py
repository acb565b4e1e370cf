"""What the bench times: its configuration (`BenchConfig`), its rows (`Case`: single, model parallel,
brigade's schedules × V × m, torch's pipelining, DDP) and the cut each row runs on (`Shape`).

`cases` lists every row of a run and the ones skipped with why; `scaled_splits` scales the
tutorial's split sizes to a batch. Pure: nothing here builds a model or a process group; the
worker that builds and times the rows is `bench.experiments`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from brigade.bench.peers import TORCH_SCHEDULES, unsupported
from brigade.measure.timing import Workload
from brigade.pipeline.plans.schedule import DEFAULT_VIRTUAL, SCHEDULES, names

TUTORIAL_SPLITS = [1, 3, 5, 8, 10, 12, 20, 40, 60]  # of a batch of 120
SINGLE, MP, OURS, PEER, DDP = "single", "model parallel", "brigade", "torch.distributed.pipelining", "ddp"


@dataclass
class BenchConfig(Workload):
    splits: list[int] = field(default_factory=list)  # split sizes; empty: the tutorial's, scaled
    schedules: list[str] = field(default_factory=names)
    balance: list[int] | None = None
    rounds: int = 10  # interleaved rounds (`repeats` stays the tuner's per-configuration count)
    ranks: int = 2  # bench: pipeline ranks, one process each (more than the cores: they share them)
    memory_per_device: float = 0.0  # tune: bytes a process may hold at its peak; 0: no limit
    compile: bool = False  # every row's blocks compiled (`copy_blocks`), as brigade train --compile


@dataclass(frozen=True)
class Case:
    """One configuration of the bench: a row of bench.json."""

    name: str  # SINGLE, MP, OURS, PEER or DDP
    schedule: str | None
    virtual: int
    microbatches: int

    @property
    def key(self) -> str:
        return f"{self.name}|{self.schedule}|V{self.virtual}|m{self.microbatches}"


Shape = tuple[int, int, str]  # (V, m, whose cut): "" the solver's, shared; a costed schedule's name: its own


def shape_of(case: Case) -> Shape:
    """The cut `case` runs on: a costed schedule's row (auto's) its own, chosen with its plan; every
    other row of the same V and m, torch's included, the solver's."""
    own = case.name == OURS and SCHEDULES[case.schedule].costed
    return case.virtual, case.microbatches, case.schedule if own else ""


def scaled_splits(batch: int) -> list[int]:
    """The tutorial's split sizes for 120 images, scaled to `batch`: for each, the divisor of
    `batch` nearest to it (so every micro-batch has the same size, which torch's pipelining needs)."""
    divisors = [d for d in range(1, batch + 1) if batch % d == 0]
    out = []
    for s in TUTORIAL_SPLITS:
        target = s * batch / 120
        size = min(divisors, key=lambda d: (abs(math.log(d / target)), d))
        if size not in out and size < batch:
            out.append(size)
    return out


def brigade_virtuals(schedule: str) -> tuple[int, ...]:
    """The stages per rank (V) the bench runs brigade's `schedule` at: the registry's fixed V;
    for a schedule that takes any V (interleaved, looped-bfs) the default, 2 (torch's too); for a
    costed one (auto) every V it runs up to that (1 and 2: it is measured against all)."""
    sched = SCHEDULES[schedule]
    if sched.costed:
        return sched.virtuals(DEFAULT_VIRTUAL)
    return (sched.virtual or DEFAULT_VIRTUAL,)


def cases(cfg: BenchConfig, ranks: int, n_blocks: int) -> tuple[list[Case], list[dict]]:
    """Every configuration to time, and the ones skipped with why.

    Brigade rows are (schedule, V, m) over `cfg.schedules` × `brigade_virtuals` × the splits.
    Torch rows are every installed torch schedule whose twin is selected, plus any without a
    brigade twin (none with torch 2.13: each of its seven has one).
    """
    ms = [math.ceil(cfg.batch_size / s) for s in cfg.splits or scaled_splits(cfg.batch_size)]
    run, skipped = [Case(SINGLE, None, 1, 1), Case(MP, "gpipe", 1, 1)], []
    for case in (Case(OURS, s, v, m) for s in cfg.schedules for v in brigade_virtuals(s) for m in ms):
        if n_blocks < ranks * case.virtual:
            skipped.append({**asdict(case), "reason": f"{cfg.model} has {n_blocks} blocks: "
                            f"{ranks * case.virtual} stages need as many"})
        else:
            run.append(case)
    for name, spec in TORCH_SCHEDULES.items():
        twin = spec.twin or name
        if twin in names() and twin not in cfg.schedules:
            continue
        for v in spec.virtual:
            for m in ms:
                reason = unsupported(name, ranks, v, m, cfg.batch_size)
                if reason is None and n_blocks < ranks * v:
                    reason = f"{cfg.model} has {n_blocks} blocks: {ranks * v} stages need as many"
                case = Case(PEER, name, v, m)
                if reason:
                    skipped.append({**asdict(case), "reason": reason})
                else:
                    run.append(case)
    return run + [Case(DDP, None, 1, 1)], skipped
