"""Choosing among configurations timed in interleaved rounds, on a machine others load too.

Other jobs on a shared machine come and go in bursts of seconds to minutes, and a round timed
during one is slower for every configuration in it. A configuration's median over its own
rounds then depends on how many of *its* rounds a burst happened to hit: a sweep of 10 GPT
configurations × 10 rounds (13 s a round) under bursts read, for data parallel,

    round     0     1     2     3     4     5     6     7     8     9     median
    ddp      0.78  0.84  2.75  1.63  0.98  1.64  1.64  1.80  2.62  1.06   1.64
    bfs V=1  1.18  1.06  0.99  1.30  0.98  1.71  1.68  1.02  1.71  1.99   1.24

ddp was the faster of the two in the rounds both ran quietly (0, 1, 4) and the fastest
configuration of the whole sweep timed quietly, yet its median was a third above bfs's: which
one looked best was decided by where the bursts fell. Every comparison here is therefore made
within rounds: a configuration's time in a round is divided by that round's median over the
configurations compared (`relative`), and configurations are ranked by the median of those
ratios over rounds (`scores`); how far one is from another is the median of their
per-round ratios (`stats.ratio_ci`). Load common to a round cancels; what a burst does to a part of a round
is noise the median over rounds absorbs.

Which configurations are timed at all comes from predictions, and data parallel and the
pipelines are predicted by different models from block costs measured at different
micro-batch sizes (a burst while one size was measured skews one family): `pick_trials`
keeps each family's best prediction among the trials.
"""

from __future__ import annotations

import statistics


def relative(times: list[list[float]]) -> list[list[float]]:
    """Each row's time in each round ÷ that round's median over the rows.

    Args:
        times: one list per row, its seconds in every round (round k of every row is one round).

    Returns:
        the same shape, every value a ratio to its round's median.

    Raises:
        ValueError: no rows, or rows with different numbers of rounds.
    """
    if not times or len({len(t) for t in times}) != 1:
        raise ValueError(f"relative() needs rows timed over the same rounds, got {[len(t) for t in times]}")
    medians = [statistics.median(column) for column in zip(*times)]
    return [[v / m for v, m in zip(row, medians)] for row in times]


def scores(times: list[list[float]]) -> list[float]:
    """Each row's median over rounds of its `relative` time: lower is faster."""
    return [statistics.median(row) for row in relative(times)]


def family(row: dict) -> str:
    """The prediction model a configuration's prediction came from: "ddp" or "pipeline"."""
    return "ddp" if row["dp"] > 1 else "pipeline"


def pick_trials(predictions: list[dict], budget: int) -> list[dict]:
    """The `budget` best-predicted configurations, each family's best among them.

    Args:
        predictions: configurations with `predicted_s` and `dp`, best first.
        budget: how many to time (at least one per family present, if it is at least that).

    Returns:
        the trials, in prediction order.
    """
    firsts: dict[str, int] = {}
    for i, row in enumerate(predictions):
        firsts.setdefault(family(row), i)
    must = sorted(firsts.values())[:budget]
    rest = [i for i in range(len(predictions)) if i not in must]
    return [predictions[i] for i in sorted(must + rest[: budget - len(must)])]
