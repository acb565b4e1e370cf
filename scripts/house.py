"""The house's import graph: brigade's modules, the rooms they make, the floors the rooms stand on.

    python scripts/house.py            rooms by floor (top first), arrows, circles, arrows running back up
    python scripts/house.py --json     the same as one JSON object

A room is one entry directly under brigade/: a package (all its modules together) or a module.
An arrow is a room importing another (anywhere in a file: inside functions and under
TYPE_CHECKING too). A room's floor is one above the highest room it imports, the ground being 1;
an arrow that runs back up is one into a room on the same floor or higher, which only a circle
of rooms makes. tests/test_imports.py holds the house to none of either, and no circle of
modules.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "brigade"


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path) -> set[str]:
    """The brigade modules `name` imports, wherever in the file (functions, TYPE_CHECKING included)."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES}
            found |= subs or {base}
    return {m for m in found if m in MODULES and m != name}


def module_graph() -> dict[str, set[str]]:
    return {m: imports(m, p) for m, p in MODULES.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def room_of(module: str) -> str:
    """brigade.pipeline.plans.action -> pipeline/; brigade.cli -> cli.py; brigade -> __init__.py."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    return f"{parts[1]}/" if (PACKAGE / parts[1]).is_dir() else f"{parts[1]}.py"


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {room_of(m): set() for m in graph}
    for m, targets in graph.items():
        rooms[room_of(m)] |= {room_of(t) for t in targets} - {room_of(m)}
    return rooms


def floors(rooms: dict[str, set[str]]) -> dict[str, int]:
    """Each room's floor: 1 + the highest floor it imports (rooms in one circle share a floor)."""
    comp = {r: min(c) for c in circles(rooms) for r in c}
    memo: dict[str, int] = {}

    def floor(r: str, seen: frozenset = frozenset()) -> int:
        key = comp.get(r, r)
        if key not in memo:
            members = [x for x in rooms if comp.get(x, x) == key]
            below = {t for x in members for t in rooms[x] if comp.get(t, t) != key and t not in seen}
            memo[key] = 1 + max((floor(t, seen | {key}) for t in below), default=0)
        return memo[key]

    return {r: floor(r) for r in rooms}


def lines(room: str) -> int:
    path = PACKAGE / room
    files = path.rglob("*.py") if path.is_dir() else [path]
    return sum(len(f.read_text(encoding="utf-8").splitlines()) for f in files)


def house() -> dict:
    graph = module_graph()
    rooms = room_graph(graph)
    at = floors(rooms)
    arrows = sorted((a, b) for a, targets in rooms.items() for b in targets)
    return {"rooms": {r: {"floor": at[r], "lines": lines(r), "imports": sorted(rooms[r])}
                      for r in sorted(rooms)},
            "floors": max(at.values()), "arrows": len(arrows),
            "arrows_back_up": [[a, b] for a, b in arrows if at[b] >= at[a]],
            "module_circles": circles(graph), "room_circles": circles(rooms)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the sheet")
    args = parser.parse_args(argv)
    h = house()
    if args.json:
        print(json.dumps(h, indent=1))
        return 0
    for floor in range(h["floors"], 0, -1):
        here = [f"{r} {v['lines']}" for r, v in h["rooms"].items() if v["floor"] == floor]
        print(f"floor {floor:2}  " + ", ".join(here))
    print(f"{len(h['rooms'])} rooms on {h['floors']} floors, {h['arrows']} arrows; "
          f"{len(h['arrows_back_up'])} running back up, {len(h['room_circles'])} circles of rooms, "
          f"{len(h['module_circles'])} of modules")
    for a, b in h["arrows_back_up"]:
        print(f"  back up: {a} -> {b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
