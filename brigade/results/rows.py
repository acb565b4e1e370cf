"""A row of the results table (docs/results.md): what was measured, its file under results/, how to
reproduce it, and the function that renders its figure. `table` and `memory_rows` each add theirs
with `adder`; `table.ROWS` puts them in the page's order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    """One line of the table: what was measured, its file under results/, how to reproduce it."""

    what: str
    file: str
    figure: Callable[[dict], str]
    reproduce: str


def adder(rows: list[Row]) -> Callable:
    """`row(what, file, reproduce)`: a decorator whose function renders the figure of a new row,
    appended to `rows` (so a module's rows stand in the order of its functions)."""
    def row(what: str, file: str, reproduce: str) -> Callable[[Callable[[dict], str]], Callable[[dict], str]]:
        def add(figure: Callable[[dict], str]) -> Callable[[dict], str]:
            rows.append(Row(what, file, figure, reproduce))
            return figure
        return add
    return row
