"""The learning rate's schedules: after the warm-up, how the rate goes from --lr to --min-lr.

    --lr-schedule cosine     (default) half a cosine, down to --min-lr at --decay-steps
    --lr-schedule wsd        warmup-stable-decay: --lr held, then a straight line down to --min-lr
                             over the last --decay-fraction of the steps up to --decay-steps
    --lr-schedule linear     a straight line down to --min-lr at --decay-steps
    --lr-schedule constant   --lr to the end

Past --decay-steps the rate stays at --min-lr (from the warm-up's end, where --decay-steps is
within it: a short run's end kept on resume). --decay-steps 0 (the default) ends the decay at
--max-steps as the run first started, and the run's snapshots keep that end (`lr_end` in their
manifest): a run resumed with another --max-steps would otherwise have its decay reshaped from
the step it resumes at, a change nobody asked for, so the resume is refused in one line that
gives both ways on (`snapshot.compat.check_schedule`): keep the end (--decay-steps OLD: the
added steps train at --min-lr) or move it (--decay-steps NEW: what is left of the decay stretches
to the new end, as the user then said). --decay-steps itself is not part of what a snapshot
must match, so either is accepted.

The configuration owns the names and what each does; the trainer computes the rate
(`train.optimizer.lr_at`).
"""

from __future__ import annotations

from brigade.errors import BrigadeError

LR_SCHEDULES = {
    "cosine": "half a cosine from --lr down to --min-lr at --decay-steps",
    "wsd": "warmup-stable-decay: --lr held, then a straight line down to --min-lr over the last "
           "--decay-fraction of the steps up to --decay-steps",
    "linear": "a straight line from --lr down to --min-lr at --decay-steps",
    "constant": "--lr to the end",
}


def decay_end(decay_steps: int, max_steps: int) -> int:
    """The step the decay reaches --min-lr at: --decay-steps, or --max-steps where it is 0."""
    return decay_steps or max_steps


def check(schedule: str, decay_steps: int, decay_fraction: float) -> None:
    """--lr-schedule, --decay-steps and --decay-fraction, before anything runs.

    Raises:
        BrigadeError: naming the value, what was expected, and how to fix it.
    """
    if schedule not in LR_SCHEDULES:
        raise BrigadeError(f"--lr-schedule {schedule!r}: expected one of {', '.join(LR_SCHEDULES)}")
    if decay_steps < 0:
        raise BrigadeError(f"--decay-steps {decay_steps}: must be ≥ 0 (0: --max-steps)")
    if not 0 < decay_fraction <= 1:
        raise BrigadeError(f"--decay-fraction {decay_fraction}: must be above 0 and at most 1 (0.2: "
                           "the last fifth of the steps up to --decay-steps)")
