"""Fault injection, for chaos-testing a setup: `--inject-fault KIND:rank=R:step=S`.

    kill                  rank R kills itself (SIGKILL) as step S begins
    stall                 rank R stops making progress as step S begins (sleeps)
    kill-during-snapshot  rank R kills itself after writing snapshot S's data, before it commits

Each fault fires once, on the first attempt only: TORCHELASTIC_RESTART_COUNT,
which the elastic agent sets, tells which attempt a worker belongs to.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

from brigade.errors import BrigadeError

KINDS = ("kill", "stall", "kill-during-snapshot")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int


def parse_fault(text: str) -> Fault:
    """``"kill:rank=1:step=7"`` → Fault.

    Raises:
        BrigadeError: an unknown kind or a malformed spec.
    """
    m = re.fullmatch(r"([a-z-]+):rank=(\d+):step=(\d+)", text.strip())
    if not m or m[1] not in KINDS:
        raise BrigadeError(f"--inject-fault {text!r}: expected KIND:rank=R:step=S with KIND one of "
                           f"{', '.join(KINDS)}, e.g. kill:rank=1:step=7")
    return Fault(m[1], int(m[2]), int(m[3]))


class FaultInjector:
    def __init__(self, fault: Fault | None, rank: int):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.fault = fault if fault is not None and fault.rank == rank and first_attempt else None
        self.should_stop = lambda: False  # the worker sets this: SIGTERM received

    def before_step(self, step: int) -> None:
        """Called as step `step` (1-based) begins."""
        f = self.fault
        if f is None or f.step != step:
            return
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if f.kind == "stall":
            self.fault = None
            while not self.should_stop():  # a hung rank: the others' hang timeout ends the run
                time.sleep(0.2)
            os._exit(1)

    def during_snapshot(self, step: int) -> None:
        f = self.fault
        if f is not None and f.kind == "kill-during-snapshot" and f.step == step:
            os.kill(os.getpid(), signal.SIGKILL)
