"""What a generated schedule is planned on (`Costs`: each stage's forward, input-gradient and
weight pass, the link delay, the activation limit, shared cores), and the measured durations
they are made from (`median_durations` of a traced step). Pure: no torch import.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from brigade.pipeline.plans.action import B, F, I, Op, W


@dataclass(frozen=True)
class Costs:
    """What a generated schedule is planned on: per stage (p·V entries, stage 0 first) the time of
    one micro-batch's forward, input-gradient pass and weight pass, in any one unit.

    Args:
        forward, input_grad, weight: per-stage costs.
        backward: per-stage whole-backward costs, if measured (stage 0 runs a whole B: it has no
            gradient to hurry upstream); else I + W.
        comm: the delay of a transfer between two ranks (none within a rank).
        limit: the most micro-batch activations a rank may hold at once, counted per stage it
            holds (a micro-batch held by two of a rank's stages counts twice); 0: no limit.
        cores: the cores the ranks share where they have fewer than one each (CPU processes on one
            host, in ranks' worth); 0: a device per rank. Plans are then compared by
            `Simulation.on_cores`: a bubble costs little, extra work (I + W > B) costs in full.
    """

    forward: tuple[float, ...]
    input_grad: tuple[float, ...]
    weight: tuple[float, ...]
    backward: tuple[float, ...] | None = None
    comm: float = 0.0
    limit: int = 0
    cores: float = 0.0

    @classmethod
    def unit(cls, n_stages: int, limit: int = 0) -> Costs:
        """`simulate`'s unit costs: a forward and a whole backward 1 each, I = W = ½."""
        return cls((1.0,) * n_stages, (0.5,) * n_stages, (0.5,) * n_stages, limit=limit)

    @classmethod
    def measured(cls, seconds: dict[tuple[int, Op], float], n_stages: int, limit: int = 0,
                 cores: float = 0.0) -> Costs:
        """Costs from measured seconds per (stage, op): F, I, W on split stages, F and B on
        stage 0 (a whole backward; its halves are taken as half of it each)."""
        def got(s: int, op: Op) -> float:
            return seconds.get((s, op), 0.0)
        whole = tuple(got(s, B) or got(s, I) + got(s, W) for s in range(n_stages))
        inp = tuple(got(s, I) or whole[s] / 2 for s in range(n_stages))
        wgt = tuple(got(s, W) or whole[s] / 2 for s in range(n_stages))
        return cls(tuple(got(s, F) for s in range(n_stages)), inp, wgt, backward=whole, limit=limit,
                   cores=cores)

    def whole(self, stage: int) -> float:
        """A whole backward's cost on `stage`."""
        if self.backward is not None:
            return self.backward[stage]
        return self.input_grad[stage] + self.weight[stage]


def median_durations(events) -> dict[tuple[int, Op], float]:
    """(stage, op) -> the median duration of its compute actions among `events`, a step's
    (action, start, end) as the runtime traces them."""
    spans: dict[tuple[int, Op], list[float]] = {}
    for a, start, end in events:
        if a.op in (F, B, I, W):
            spans.setdefault((a.stage, a.op), []).append(end - start)
    return {k: statistics.median(v) for k, v in spans.items()}
