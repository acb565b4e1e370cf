"""docs/results.md as written from results/: its table and every paragraph that quotes a figure.

    python -m brigade.results --page     # rewrite the page's blocks from the files

The page marks what is written here with `<!-- results: NAME -->` … `<!-- /results -->`; BLOCKS
says what renders each (the table, `table.table`; the paragraphs, `prose`). Between the blocks
the page is hand-written and quotes no figure. tests/test_results.py fails when a block differs
from what its files give, so a paragraph cannot keep a figure its file no longer holds.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from brigade.results import prose
from brigade.results.table import table

PAGE = Path(__file__).resolve().parents[2] / "docs" / "results.md"
BLOCK = re.compile(r"(<!-- results: ([\w-]+) -->\n)(.*?)(\n<!-- /results -->)", re.S)

BLOCKS: dict[str, Callable[[Path], str]] = {"table": table, **prose.PARAGRAPHS}


def render(text: str, results: Path) -> str:
    """The page with each block rewritten from the files under `results`.

    Raises:
        KeyError: a block names no renderer of BLOCKS.
    """
    return BLOCK.sub(lambda m: m[1] + BLOCKS[m[2]](results) + m[4], text)


def names(text: str) -> list[str]:
    """The blocks a page holds, in its order."""
    return [m[2] for m in BLOCK.finditer(text)]


def rewrite(results: Path, page: Path = PAGE) -> bool:
    """Rewrite the page's blocks; whether anything changed."""
    text = page.read_text(encoding="utf-8")
    new = render(text, results)
    if new != text:
        page.write_text(new, encoding="utf-8")
    return new != text
