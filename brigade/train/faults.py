"""Fault injection, for chaos-testing a setup: `--inject-fault KIND:rank=R:step=S`.

    kill                  rank R kills itself (SIGKILL) as step S begins
    stall                 rank R stops making progress as step S begins (sleeps)
    kill-during-snapshot  rank R kills itself as it starts writing its part of snapshot S: the
                          snapshot is never complete, in the background or not
    nan                   rank R's forward turns NaN during step S: its loss (or, on an earlier
                          pipeline stage, the loss it feeds) becomes NaN, as a diverging run's does

Each fault fires once, on the first attempt only: TORCHELASTIC_RESTART_COUNT,
which the elastic agent sets, tells which attempt a worker belongs to. A fault at a step first
waits for a snapshot still being written in the background to be complete on disk
(`settled`), so which snapshot a restart resumes from does not hang on timing; a kill at a
random moment is a kill from outside (tests/e2e/test_kill_campaign.py).
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_map

from brigade.errors import BrigadeError

KINDS = ("kill", "stall", "kill-during-snapshot", "nan")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int


def parse_fault(text: str, world: int | None = None, max_steps: int | None = None) -> Fault:
    """``"kill:rank=1:step=7"`` → Fault, checked against the run when `world` / `max_steps` are given.

    Raises:
        BrigadeError: an unknown kind, a malformed spec, or a rank or step the run does not have.
    """
    m = re.fullmatch(r"([a-z-]+):rank=(\d+):step=(\d+)", text.strip())
    if not m or m[1] not in KINDS:
        raise BrigadeError(f"--inject-fault {text!r}: expected KIND:rank=R:step=S with KIND one of "
                           f"{', '.join(KINDS)}, e.g. kill:rank=1:step=7")
    fault = Fault(m[1], int(m[2]), int(m[3]))
    if world is not None and fault.rank >= world:
        raise BrigadeError(f"--inject-fault {text!r}: rank {fault.rank} does not exist in a world of "
                           f"{world} processes: give a rank from 0 to {world - 1}")
    if fault.step < 1 or (max_steps is not None and fault.step > max_steps):
        upto = f" to --max-steps {max_steps}" if max_steps is not None else " or more"
        raise BrigadeError(f"--inject-fault {text!r}: step {fault.step} is never run: give a step "
                           f"from 1{upto}")
    return fault


class FaultInjector:
    """Fires this rank's fault, if it has one, from the hooks the worker wires up."""

    def __init__(self, fault: Fault | None, rank: int):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.fault = fault if fault is not None and fault.rank == rank and first_attempt else None
        self.should_stop = lambda: False  # the worker sets this: SIGTERM received
        self.settled = lambda: None  # the worker sets this: wait for a snapshot in flight to land
        self.poisoning = False  # nan: this step's training forward passes turn NaN

    def attach(self, model: nn.Module) -> None:
        """For a nan fault: hook the first of this rank's blocks (`model`'s first child module)."""
        if self.fault is None or self.fault.kind != "nan":
            return
        first = next(m for m in model.modules() if not list(m.children()))
        first.register_forward_hook(self._poison)

    def _poison(self, module: nn.Module, inputs, output):
        if not (self.poisoning and module.training):
            return None
        return tree_map(lambda t: t * float("nan") if torch.is_tensor(t) and t.is_floating_point()
                        else t, output)

    def before_step(self, step: int) -> None:
        """Called as step `step` (1-based) begins."""
        f = self.fault
        self.poisoning = f is not None and f.kind == "nan" and f.step == step
        if f is None or f.step != step or f.kind == "kill-during-snapshot":
            return
        self.settled()
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
