"""Schedules as data: plans, the registry, the checks and the simulator (no torch import).

This package imports its builders first, whichever plan module is asked for (a package runs
before any of its modules): `schedule`'s, then `virtual`'s, then `generate`'s (auto) register in
that order, which is the order of every help text and of the bench's rows. Imported first on its
own, `generate` would put auto before the rest; and `generate` compares its plans with the others'
through `simulate`, which `schedule` must not import back.
"""

from brigade.pipeline.plans import schedule as _schedule  # noqa: F401,I001  (the registry's order)
from brigade.pipeline.plans import virtual as _virtual  # noqa: F401 -- interleaved, looped-bfs, zbv, dualpipev
from brigade.pipeline.plans import generate as _generate  # noqa: F401 -- auto
