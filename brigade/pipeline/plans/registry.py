"""The one registry of schedule names: each name's builder, placement, the V it runs and its help
line. The CLI, the configuration's checks, the benchmarks and the tuner ask it; builders join it
with `@register` (`schedule.py`: one stage per rank; `virtual.py`: several). No torch import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from brigade.pipeline.plans.action import PLACEMENTS, SINGLE, Builder, Placement, PlanError


@dataclass(frozen=True)
class Schedule:
    """A registered schedule: its name on the command line, its builder, one line for help texts,
    its placement (`PLACEMENTS`) and the stages per rank it runs: `virtual` = that fixed V, or
    None for any V ≥ 1 (then `DEFAULT_VIRTUAL` unless asked)."""

    name: str
    build: Builder
    description: str
    placement: Placement = SINGLE
    virtual: int | None = 1

    def resolve_virtual(self, virtual: int = 0, flag: str = "--virtual") -> int:
        """The V this schedule runs with: `virtual`, or its default when 0.

        Raises:
            PlanError: a V this schedule cannot run, naming what it can.
        """
        if virtual == 0:
            return self.virtual or DEFAULT_VIRTUAL
        if virtual < 0 or (self.virtual is not None and virtual != self.virtual):
            can = f"exactly {self.virtual}" if self.virtual else "any V of 1 or more"
            hint = "; interleaved, looped-bfs, zbv and dualpipev hold several" if self.virtual == 1 else ""
            raise PlanError(f"{flag} {virtual}: schedule {self.name} runs {can} stage(s) per rank"
                            f"{hint}")
        return virtual


SCHEDULES: dict[str, Schedule] = {}
DEFAULT = "1f1b"
DEFAULT_VIRTUAL = 2  # stages per rank of a schedule that takes any V, when none is asked


def register(name: str, description: str, placement: Placement = SINGLE,
             virtual: int | None = 1) -> Callable[[Builder], Builder]:
    """Decorator: make a builder `(n_ranks, n_microbatches, n_virtual) -> Plan` available as `name`.

    Args:
        placement: "single", "loop" or "v" (module docstring). virtual: the V it runs, or None (any).
    """
    if placement not in PLACEMENTS:  # a plain "loop" is one too: Placement is a str
        raise ValueError(f"placement {placement!r}: expected one of {', '.join(PLACEMENTS)}")

    def add(builder: Builder) -> Builder:
        SCHEDULES[name] = Schedule(name, builder, description, placement, virtual)
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
