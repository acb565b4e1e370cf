"""Mixed precision for training: fp16's loss scaling. The precisions a run may name and the
autocast dtype each means are the configuration's (`config/precision.py`: `autocast_dtype`).

Whatever the dtype, the loss is computed and summed in fp32 (`pipeline/runtime/handlers.py`).

fp16 keeps 5 exponent bits: small gradients underflow to zero in the backward. The loss is
multiplied by a power of two before backward (the pipelines' `loss_scale`) and the gradients
divided by it before clipping and the optimizer step. The decision to skip a step whose scaled
gradients overflowed is read from the whole model's gradient norm, which every process
already holds: reduced over stages, from gradients already reduced over replicas (an inf
anywhere makes it inf everywhere). So every stage and every replica skips the same steps and
keeps the same scale, with no collective of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class LossScaler:
    """fp16's loss scale: halved on a step whose gradients overflow (the step is skipped),
    doubled after `growth_interval` good steps in a row (torch.amp.GradScaler's rule).

    Below `min_scale` it gives up: a gradient that overflows unscaled is a real divergence,
    and the trainer's non-finite check stops the run as it does in fp32.
    """

    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    good_steps: int = 0

    def skip(self, norm: float) -> bool:
        """Whether to skip the step whose (unscaled) gradient norm is `norm`; updates the scale.

        Every process calls this with the same norm, so all agree and keep the same scale.
        """
        if math.isfinite(norm):
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0
            return False
        if self.scale * self.backoff_factor < self.min_scale:
            return False  # not skipped: the non-finite check reports it
        self.scale *= self.backoff_factor
        self.good_steps = 0
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
