"""What a benchmark run as `python -m brigade.results.NAME` shares: its JSON and plot written side by
side, and its errors as one line with exit 2."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from brigade.errors import BrigadeError


def save(result: dict, out: str | Path, name: str, draw: Callable[[dict, Path], None]) -> None:
    """OUT/NAME.json, then OUT/NAME.png drawn from it by `draw(result, path)`; says it wrote both."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    draw(result, out / f"{name}.png")
    print(f"wrote {out / f'{name}.json'} and {out / f'{name}.png'}")


def run(main: Callable[[], int], prog: str) -> None:
    """Exit with `main()`'s code; a BrigadeError is one line on stderr and exit 2."""
    try:
        sys.exit(main())
    except BrigadeError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        sys.exit(2)
