"""Cost a plan: `simulate` it under per-stage costs (when each action runs, the makespan, the
bubble), `peak_held` (the activations each stage holds at once) and `render` it as a grid.

A plan comes from `schedule.py` or `virtual.py` (or by hand, in tests); nothing here runs torch
or processes (no torch import). The timing itself is `timeline.execute`, the same list
scheduler that `validate` runs to find deadlocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from brigade.pipeline.plans.action import Action, B, F, I, Plan, W
from brigade.pipeline.plans.schedule import compute_only
from brigade.pipeline.plans.timeline import execute
from brigade.pipeline.plans.validate import validate


@dataclass
class Simulation:
    """Result of `simulate`: times are in the units of the costs given."""

    makespan: float
    timeline: dict[int, list[tuple[Action, float, float]]]
    busy: dict[int, float]
    bubble_fraction: float
    idle: dict[int, float] = field(default_factory=dict)
    peak_held: dict[int, int] = field(default_factory=dict)  # stage -> micro-batches held at once

    def on_cores(self, cores: float) -> float:
        """The step's time where its ranks share `cores` (fewer than one a rank: CPU processes on
        one host): at least all their work ÷ `cores`, as a rank's idle core goes to another rank;
        the makespan when `cores` is 0 or at least one a rank."""
        if not 0 < cores < len(self.busy):
            return self.makespan
        return max(self.makespan, sum(self.busy.values()) / cores)


def simulate(plan: Plan, forward, backward=None, comm: float = 0.0, weight=None,
             input_grad=None) -> Simulation:
    """Cost a plan: when each action runs, the makespan, and the bubble.

    Args:
        plan: a valid plan (compute-only or with comms).
        forward: per-micro-batch forward cost, one float for all stages or a list per stage
            (indexed by stage: P·V entries when ranks hold several stages).
        backward: same for a whole backward (B); defaults to the forward costs.
        comm: delay between a stage finishing and its neighbour being able to start.
        weight: for split backwards, the W part of `backward` (I costs the rest);
            defaults to half of it.
        input_grad: the I part of a split backward, when measured: splitting a backward in two
            passes costs more than one (on CPU, the benches' last stages: I + W = 1.00-1.15 × B),
            so measured costs give both halves; without it I = `backward` − `weight`.

    Returns:
        Simulation with makespan, per-rank timeline (action, start, end), busy
        time, idle time and bubble fraction = idle / (ranks × makespan).
    """
    plan = compute_only(validate(plan))
    backward = forward if backward is None else backward

    def cost(stage: int, op: str) -> float:
        if op == "comm":
            return comm
        if op == F:
            return per_stage(forward, stage)
        b = per_stage(backward, stage)
        i, w = halves(b, stage, weight, input_grad)
        return {B: b, I: i, W: w}[op]

    timeline = execute(plan, cost)
    makespan = max((end for tl in timeline.values() for _, _, end in tl), default=0.0)
    busy = {r: sum(e - s for _, s, e in tl) for r, tl in timeline.items()}
    idle = {r: makespan - b for r, b in busy.items()}
    total = makespan * len(plan)
    bubble = sum(idle.values()) / total if total else 0.0
    return Simulation(makespan, timeline, busy, bubble, idle, peak_held(plan))


def halves(b: float, stage: int, weight, input_grad) -> tuple[float, float]:
    """(I, W) of a backward costing `b`: measured, or I = b - W with W half of b by default."""
    if input_grad is not None:
        return per_stage(input_grad, stage), per_stage(weight, stage)
    w = b / 2 if weight is None else min(per_stage(weight, stage), b)
    return b - w, w


def per_stage(c, stage: int) -> float:
    return float(c[stage]) if isinstance(c, (list, tuple)) else float(c)


def peak_held(plan: Plan) -> dict[int, int]:
    """Per stage, the most micro-batches whose activations it holds at once (F done, B or W not).

    Memory in units of one micro-batch's activations of that stage: what a schedule costs in
    memory, independent of the model (GPipe: m; 1F1B: p - s on stage s).
    """
    held: dict[int, int] = {}
    peak: dict[int, int] = {}
    for acts in compute_only(plan).values():
        for a in acts:
            if a.op == F:
                held[a.stage] = held.get(a.stage, 0) + 1
                peak[a.stage] = max(peak.get(a.stage, 0), held[a.stage])
            elif a.op in (B, W):
                held[a.stage] -= 1
    return dict(sorted(peak.items()))


def render(plan: Plan, forward: float = 1.0, backward: float = 1.0) -> str:
    """ASCII grid of a plan: time across, ranks down.

    One column is the shortest action's duration; a longer action fills its
    first column with its name and the rest with ``~``.
    """
    sim = simulate(plan, forward, backward)
    durations = [e - s for tl in sim.timeline.values() for _, s, e in tl if e > s]
    unit = min(durations, default=1.0)
    width = max(len(str(a)) for acts in plan.values() for a in acts) + 1
    slots = int(round(sim.makespan / unit))
    lines = ["t      | " + "".join(f"{t:<{width}}" for t in range(slots))]
    for r, tl in sim.timeline.items():
        cells = ["." for _ in range(slots)]
        for a, start, end in tl:
            first, last = int(round(start / unit)), int(round(end / unit))
            for t in range(first, last):
                cells[t] = str(a) if t == first else "~"
        lines.append(f"rank {r:<2}| " + "".join(f"{c:<{width}}" for c in cells))
    lines.append(f"bubble {sim.bubble_fraction:.3f}  makespan {sim.makespan:g}")
    return "\n".join(line.rstrip() for line in lines)
