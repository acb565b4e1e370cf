"""Schedules as data: plans, the registry, the checks and the simulator (no torch import).

The schedule module is imported first, whichever plan module is asked for: its builders, then
`virtual`'s, then `generate`'s (auto) register in that order, which is the order of every help
text and of the bench's rows. Imported first on its own, `generate` would put auto before the rest.
"""

from brigade.pipeline.plans import schedule as _schedule  # noqa: F401  (the registry's order)
