"""What a benchmark run as `python -m brigade.results.NAME` shares: its JSON and plot written side by
side, and its errors as one line with exit 2."""

from __future__ import annotations

import argparse
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


def parser(prog: str, doc: str, out: str, written: str, tiny: str) -> argparse.ArgumentParser:
    """A benchmark's command line: its --out folder (`out`, where `written` goes) and --tiny
    (what the tiny sizes test), described by the first line of its docstring `doc`."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    p.add_argument("--out", default=out, help=f"folder for {written}")
    p.add_argument("--tiny", action="store_true", help=f"tiny sizes: {tiny}")
    return p


def close(fig, path: Path) -> None:
    """Lay out, write and close a figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(main: Callable[[], int], prog: str) -> None:
    """Exit with `main()`'s code; a BrigadeError is one line on stderr and exit 2."""
    try:
        sys.exit(main())
    except BrigadeError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        sys.exit(2)
