"""The one registry of schedule names: each name's builder, placement, the V it runs and its help
line. The CLI, the configuration's checks, the benchmarks and the tuner ask it; builders join it
with `@register` (`schedule.py`: one stage per rank; `virtual.py`: several). No torch import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from brigade.pipeline.plans.action import LOOP, PLACEMENTS, SINGLE, V_SHAPE, Builder, Placement, PlanError


@dataclass(frozen=True)
class Schedule:
    """A registered schedule: its name on the command line, its builder, one line for help texts,
    its placement (`PLACEMENTS`) and the stages per rank it runs: `virtual` = that fixed V, or
    None for any V ≥ 1 (then `DEFAULT_VIRTUAL` unless asked), up to `most_virtual` if set. A
    `costed` schedule's builder also takes `costs=` (`plans.costs.Costs`: what it is planned on); the
    others' plans depend on sizes only."""

    name: str
    build: Builder
    description: str
    placement: Placement = SINGLE
    virtual: int | None = 1
    costed: bool = False
    most_virtual: int | None = None

    def virtuals(self, upto: int) -> tuple[int, ...]:
        """The V this schedule runs, up to `upto`: its fixed V, or 1..min(upto, most_virtual)."""
        if self.virtual:
            return (self.virtual,)
        return tuple(range(1, min(upto, self.most_virtual or upto) + 1))

    def resolve_virtual(self, virtual: int = 0, flag: str = "--virtual") -> int:
        """The V this schedule runs with: `virtual`, or its default when 0.

        Raises:
            PlanError: a V this schedule cannot run, naming what it can.
        """
        if virtual == 0:
            return self.virtual or DEFAULT_VIRTUAL
        if virtual < 0 or (self.virtual is not None and virtual != self.virtual) or \
                (self.most_virtual is not None and virtual > self.most_virtual):
            can = f"exactly {self.virtual}" if self.virtual else \
                f"1 to {self.most_virtual}" if self.most_virtual else "any V of 1 or more"
            hint = "; interleaved, looped-bfs, zbv and dualpipev hold several" if self.virtual == 1 else ""
            raise PlanError(f"{flag} {virtual}: schedule {self.name} runs {can} stage(s) per rank"
                            f"{hint}")
        return virtual


SCHEDULES: dict[str, Schedule] = {}
DEFAULT = "1f1b"
DEFAULT_VIRTUAL = 2  # stages per rank of a schedule that takes any V, when none is asked


def register(name: str, description: str, placement: Placement = SINGLE, virtual: int | None = 1,
             costed: bool = False, most_virtual: int | None = None) -> Callable[[Builder], Builder]:
    """Decorator: make a builder `(n_ranks, n_microbatches, n_virtual) -> Plan` available as `name`.

    Args:
        placement: "single", "loop" or "v" (module docstring). virtual: the V it runs, or None (any).
        costed: the builder takes `costs=` too (a plan generated from measured costs).
        most_virtual: with virtual None, the largest V it runs (None: any).
    """
    if placement not in PLACEMENTS:  # a plain "loop" is one too: Placement is a str
        raise ValueError(f"placement {placement!r}: expected one of {', '.join(PLACEMENTS)}")

    def add(builder: Builder) -> Builder:
        SCHEDULES[name] = Schedule(name, builder, description, placement, virtual, costed, most_virtual)
        return builder
    return add


def names() -> list[str]:
    """The registered schedules' names, in registration order."""
    return list(SCHEDULES)


def expected() -> str:
    """``"gpipe, 1f1b or zb"``: the names as an error message lists them."""
    *rest, last = names()
    return f"{', '.join(rest)} or {last}" if rest else last


def help_text() -> str:
    """One line per schedule for a flag's help: ``gpipe: all forwards, then all backwards; ...``."""
    return "; ".join(f"{s.name}: {s.description}" for s in SCHEDULES.values())


def check(name: str, flag: str = "--schedule") -> str:
    """Return `name` if it is a registered schedule.

    Raises:
        PlanError: naming the flag, the value and the registered names.
    """
    if name not in SCHEDULES:
        raise PlanError(f"{flag} {name!r}: unknown schedule: expected {expected()}")
    return name


def place(placement: Placement, n_ranks: int, n_virtual: int) -> list[int]:
    """The rank of each of the n_ranks · n_virtual stages under `placement` (one V of 1 is one
    stage per rank under any placement)."""
    p, n = n_ranks, n_ranks * n_virtual
    if placement == SINGLE or placement == LOOP:
        return [s % p for s in range(n)]
    if placement == V_SHAPE:
        if n_virtual not in (1, 2):
            raise PlanError(f"the V placement holds 2 stages per rank (or 1), not {n_virtual}")
        return [s if s < p else 2 * p - 1 - s for s in range(n)]
    raise PlanError(f"placement {placement!r}: expected one of {', '.join(PLACEMENTS)}")
