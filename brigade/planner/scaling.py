"""The costs measured here (`planner.costs`) as a target device would run them.

Compute by the ratio of this machine's probed fp32 peak to the target's peak for the run's
precision (the same fraction of peak there as here: "scaled"; "measured" when the target is
this machine, in the run's precision), the optimizer step by memory bandwidth; on a GPU the
optimizer's temporaries are its foreach update's (`optimizer.gpu_transient`).
"""

from __future__ import annotations

import copy

from brigade.planner.costs import HALF, MEASURED, SCALED, ModelCosts
from brigade.planner.devices import DeviceSpec
from brigade.planner.optimizer import gpu_transient


def scaled(costs: ModelCosts, target: DeviceSpec, precision: str) -> ModelCosts:
    """`costs` as the target device would run them (module docstring).

    Raises:
        BrigadeError: the target has no known peak for `precision` (DeviceSpec.peak).
    """
    peak = target.peak(precision)
    if target.measured and target.name == costs.here.name and \
            (precision if precision in HALF else "") == costs.precision:
        return costs  # measured here, in the run's precision
    here = costs.here.peak("")
    out = copy.copy(costs)
    out.scale, out.mem_scale = here / peak, costs.here.mem_bw / target.mem_bw
    out.source = SCALED if costs.source == MEASURED else costs.source
    if not target.cores:  # a GPU: AdamW's foreach update there
        out.opt_transient, out.opt_foreach = gpu_transient(costs.params), True
    return out
