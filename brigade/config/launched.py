"""The world a launcher started: how many processes, and how many on this node."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Launched:
    """The processes of a run as a launcher started them.

    size: processes in all; local: on this node (None: the launcher does not say);
    launcher: who started them, for messages ("torchrun", "Slurm").
    """

    size: int
    local: int | None = None
    launcher: str = "the launcher"
