"""PyTorch's own `torch.distributed.pipelining`, driven on the same stages, for comparison.

One table (`TORCH_SCHEDULES`) maps brigade's schedule names to torch's classes, with the
placement of stages on ranks each needs and the stages per rank (V) the bench times:

    loop  stage s on rank s mod p               p = 2, V = 2:  rank 0: 0, 2   rank 1: 1, 3
    v     stage s on rank s, then 2p - 1 - s    p = 2, V = 2:  rank 0: 0, 3   rank 1: 1, 2

Only the classes the installed torch has are in the table (found with getattr): an older
torch simply offers fewer peers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from brigade.pipeline.plans.schedule import place


@dataclass(frozen=True)
class TorchSchedule:
    """A torch schedule class, the placement it expects, and the V values the bench runs it at.

    `twin` is the brigade schedule compared with it (None: a torch-only row, none today: brigade
    has all seven); `note` says why when the pairing is only the nearest one.
    """

    cls: str
    placement: str  # "loop" or "v"
    virtual: tuple[int, ...]
    twin: str | None
    note: str = ""


_TABLE = {
    "gpipe": TorchSchedule("ScheduleGPipe", "loop", (1,), "gpipe"),
    "1f1b": TorchSchedule("Schedule1F1B", "loop", (1,), "1f1b"),
    "interleaved": TorchSchedule("ScheduleInterleaved1F1B", "loop", (2,), "interleaved"),
    "looped-bfs": TorchSchedule("ScheduleLoopedBFS", "loop", (2,), "looped-bfs"),
    # torch has no single-stage zero-bubble class; its interleaved zero-bubble accepts V = 1,
    # where it is ZB-H1's split backward on one stage per rank: the nearest to brigade's zb.
    "zb": TorchSchedule("ScheduleInterleavedZeroBubble", "loop", (1,), "zb",
                        "nearest: torch's InterleavedZeroBubble at V = 1"),
    "zbv": TorchSchedule("ScheduleZBVZeroBubble", "v", (2,), "zbv"),
    "dualpipev": TorchSchedule("ScheduleDualPipeV", "v", (2,), "dualpipev"),
}


def _installed() -> dict[str, TorchSchedule]:
    try:
        from torch.distributed import pipelining
    except ImportError:  # a torch built without distributed: no peers at all
        return {}
    return {name: s for name, s in _TABLE.items() if getattr(pipelining, s.cls, None) is not None}


TORCH_SCHEDULES: dict[str, TorchSchedule] = _installed()


def nearest_torch_schedule(schedule: str) -> str:
    """`schedule` if torch has it, else its closest torch relative (1F1B: every schedule's base)."""
    return schedule if schedule in TORCH_SCHEDULES else "1f1b"


def local_stages(placement: str, rank: int, ranks: int, virtual: int) -> list[int]:
    """The global stage indices `rank` holds, in increasing order (torch's list order).

    The placement itself has one owner, brigade's `schedule.place`: torch's is the same rule.
    """
    return [s for s, r in enumerate(place(placement, ranks, virtual)) if r == rank]


def unsupported(schedule: str, ranks: int, virtual: int, n_microbatches: int, batch: int) -> str | None:
    """Why torch cannot run this configuration (its constructors' rules), or None if it can.

    Returns:
        A reason a row cannot be timed, for the bench's `skipped` list.
    """
    spec = TORCH_SCHEDULES.get(schedule)
    if spec is None:
        return f"torch {torch.__version__} has no peer for {schedule}"
    if virtual not in spec.virtual:
        return f"torch's {spec.cls} is timed at V in {spec.virtual}, not V = {virtual}"
    if batch % n_microbatches:
        return f"torch needs equal micro-batches: batch {batch} is not a multiple of m = {n_microbatches}"
    rounds = max(1, n_microbatches // ranks)
    multi = virtual > 1 or spec.cls == "ScheduleInterleavedZeroBubble"
    if multi and n_microbatches % rounds:
        return f"torch's {spec.cls} needs m a multiple of max(1, m // p) = {rounds}, got m = {n_microbatches}"
    if spec.cls == "ScheduleDualPipeV" and n_microbatches < ranks * virtual:
        return f"torch's DualPipeV needs m >= {ranks * virtual} stages, got m = {n_microbatches}"
    return None


class TorchPipelining:
    """This rank's stages under one of torch.distributed.pipelining's schedules.

    Args:
        modules: global stage index -> module, for the stages this rank holds (one for GPipe,
            1F1B and zb's peer; V for the multi-stage schedules), on `device`.
        n_stages: stages in the whole pipeline (ranks × V).
        schedule: a key of `TORCH_SCHEDULES`.
        n_microbatches: micro-batches per step; loss_fn: (output, target) -> mean loss.

    Raises:
        KeyError: `schedule` is not in `TORCH_SCHEDULES` (check `unsupported` first).
        ValueError: torch refuses the configuration (its own message).
    """

    def __init__(self, modules: dict[int, nn.Module], n_stages: int, schedule: str,
                 n_microbatches: int, loss_fn, device: torch.device, group=None):
        from torch.distributed import pipelining

        spec = TORCH_SCHEDULES[schedule]
        order = sorted(modules)
        self.module = modules[order[0]] if len(order) == 1 else nn.ModuleList(modules[s] for s in order)
        self.is_first, self.is_last = 0 in modules, n_stages - 1 in modules
        stages = [pipelining.PipelineStage(modules[s], s, n_stages, device, group=group) for s in order]
        cls = getattr(pipelining, spec.cls)
        multi = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)
        self.schedule = cls(stages if multi else stages[0], n_microbatches, loss_fn=loss_fn)

    def step(self, x: torch.Tensor | None, y: torch.Tensor | None) -> None:
        """One training step: the first stage's rank feeds `x`, the last stage's gets `y`."""
        if self.is_first and self.is_last:
            self.schedule.step(x, target=y, losses=[])
        elif self.is_first:
            self.schedule.step(x)
        elif self.is_last:
            self.schedule.step(target=y, losses=[])
        else:
            self.schedule.step()
