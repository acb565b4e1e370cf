"""Rules of the house that the imports must keep (tests/test_imports.py is their one owner).

- A module whose docstring says it imports no torch imports none, not even through a package's
  `__init__`: checked in a fresh interpreter for every such module, found by its docstring.
- Models know nothing of parallelism: brigade/models imports nothing from pipeline, parallel,
  train, measure, planner, bench, results, check or config; parallel/ (what wraps a stage from
  outside) and pipeline/ import nothing of what builds or measures the stages (train, check,
  measure, planner, bench, results); and the configuration imports nothing of what runs it
  (train, measure, planner, bench, results, check, the CLI, the launcher).
- Measuring, planning, the commands and the results scripts are floors, lowest first: measure/
  imports nothing of planner, bench, results, the CLI or the doctor; planner/ nothing of bench or
  results; bench/ nothing of results.
- pipeline/ is built in floors (plans, stages, batches, transport, runtime, lowest first; pipe.py
  on top): a module imports nothing from a floor above its own, and every plan module is pure.
- No import circles inside brigade/ (modules importing each other, directly or round a loop),
  counting imports inside functions and under TYPE_CHECKING too; and none between rooms (brigade/'s
  packages and top-level modules), so no arrow runs back up the house (`python scripts/house.py`
  draws it).
- One owner of the parallel world: only brigade/world/ builds a DeviceMesh or computes a rank from
  coordinates (or coordinates from a rank).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest


def _house():
    """scripts/house.py: the one reader of brigade's imports (also a command: `python scripts/house.py`)."""
    spec = importlib.util.spec_from_file_location("house", Path(__file__).parents[1] / "scripts" / "house.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HOUSE = _house()
PACKAGE, MODULES, _imports, _circles = HOUSE.PACKAGE, HOUSE.MODULES, HOUSE.imports, HOUSE.circles


def _torch_free() -> list[str]:
    said = re.compile(r"\bno torch import\b|\bwithout torch\b", re.IGNORECASE)
    return [m for m, p in MODULES.items() if said.search(ast.get_docstring(ast.parse(p.read_text())) or "")]


def test_some_modules_say_they_import_no_torch():
    assert len(_torch_free()) >= 4  # the plans, ordering, the launcher's env, elastic ranges


@pytest.mark.parametrize("module", _torch_free())
def test_a_module_that_says_it_imports_no_torch_imports_none(module):
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"{module} imports torch: {result.stdout.strip()}"


def test_models_import_nothing_of_parallelism():
    banned = ("brigade.pipeline", "brigade.parallel", "brigade.train", "brigade.measure", "brigade.planner",
              "brigade.bench", "brigade.results", "brigade.check", "brigade.config")
    wrong = {m: sorted(i for i in _imports(m, p) if i.startswith(banned))
             for m, p in MODULES.items() if m.startswith("brigade.models")}
    assert not {m: i for m, i in wrong.items() if i}, wrong


def test_wrappers_and_the_pipeline_import_nothing_that_builds_the_stages():
    """parallel/ wraps a stage and pipeline/ runs it; train, check and bench build them, measure and
    planner time and predict them, the results scripts run them all."""
    banned = ("brigade.train", "brigade.measure", "brigade.planner", "brigade.bench", "brigade.results",
              "brigade.check", "brigade.cli")
    wrong = {m: sorted(i for i in _imports(m, p) if i.startswith(banned))
             for m, p in MODULES.items() if m.startswith(("brigade.parallel", "brigade.pipeline"))}
    assert not {m: i for m, i in wrong.items() if i}, wrong
    runtime = {m: sorted(i for i in _imports(m, p) if i.startswith("brigade.parallel"))
               for m, p in MODULES.items() if m.startswith("brigade.pipeline")}
    assert not {m: i for m, i in runtime.items() if i}, runtime  # the runtime sees only torch's wrappers


# pipeline/'s floors, lowest first: a module imports only from its own floor and those below.
FLOORS = ["plans", "stages", "batches", "transport", "runtime"]


def _floor(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["brigade", "pipeline"] or len(parts) < 4:
        return None
    return FLOORS.index(parts[2])


def test_pipeline_floors_import_only_downwards():
    up = {m: sorted(i for i in _imports(m, p) if (_floor(i) or 0) > _floor(m))
          for m, p in MODULES.items() if _floor(m) is not None}
    assert not {m: i for m, i in up.items() if i}, up


def test_the_registry_is_asked_through_schedule_which_loads_every_builder():
    """`plans.registry` fills as the builder modules import; `plans.schedule` imports them all.
    A module that imported the registry alone could see it empty (a test parametrized over it
    would then run no case), so outside plans/ every module asks `plans.schedule`."""
    direct = sorted(m for m, p in MODULES.items() if not m.startswith("brigade.pipeline.plans")
                    and "brigade.pipeline.plans.registry" in _imports(m, p))
    tests = sorted(str(p.relative_to(PACKAGE.parent)) for p in (PACKAGE.parent / "tests").rglob("*.py")
                   if re.search(r"plans\.registry import|plans import (\w+, )*registry\b", p.read_text())
                   and p.name != "test_schedule.py")  # that one registers a schedule of its own
    assert direct == [] and tests == [], (direct, tests)
    code = "from brigade.pipeline.plans.schedule import names; print(' '.join(names()))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == ["gpipe", "1f1b", "zb", "interleaved", "looped-bfs", "zbv", "dualpipev",
                                     "auto"]


def test_every_plan_module_says_it_imports_no_torch():
    plans = [m for m in MODULES if m.startswith("brigade.pipeline.plans.") and not m.endswith("__init__")]
    assert plans and set(plans) <= set(_torch_free()), sorted(set(plans) - set(_torch_free()))


def test_config_imports_nothing_that_runs_it():
    """The configuration sits below training, benchmarks and checks: they read it, not it them."""
    banned = ("brigade.train", "brigade.measure", "brigade.planner", "brigade.bench", "brigade.results",
              "brigade.check", "brigade.cli", "brigade.launcher.agent")
    wrong = {m: sorted(i for i in _imports(m, p) if i.startswith(banned))
             for m, p in MODULES.items() if m.startswith("brigade.config")}
    assert not {m: i for m, i in wrong.items() if i}, wrong


# What each of the measuring floors must not import: what sits above it.
ABOVE = {
    "brigade.measure": ("brigade.planner", "brigade.bench", "brigade.results", "brigade.cli",
                        "brigade.doctor"),
    "brigade.planner": ("brigade.bench", "brigade.results"),
    "brigade.bench": ("brigade.results",),
}


@pytest.mark.parametrize("package", list(ABOVE))
def test_measuring_planning_and_the_commands_import_nothing_above_them(package):
    """measure/ times and counts, planner/ predicts on what it measures, bench/ holds the bench
    and tune commands, results/ the scripts that write results/: each imports only downwards."""
    wrong = {m: sorted(i for i in _imports(m, p) if i.startswith(ABOVE[package]))
             for m, p in MODULES.items() if m == package or m.startswith(package + ".")}
    assert len(wrong) > 1, f"{package} holds no modules: fix ABOVE"
    assert not {m: i for m, i in wrong.items() if i}, wrong


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    graph = {m: _imports(m, p) for m, p in MODULES.items()}
    assert _circles(graph) == []


def test_no_circle_of_rooms_so_no_arrow_runs_back_up():
    """Rooms are brigade/'s packages and top-level modules; each stands above all it imports."""
    house = HOUSE.house()
    assert house["room_circles"] == [] and house["arrows_back_up"] == [], house["arrows_back_up"]


MESH_MAKERS = {"init_device_mesh", "DeviceMesh", "._flatten", "new_subgroups_by_enumeration"}


def _calls(path: Path) -> set[str]:
    """The names a module calls; a method as `.name` (a mesh's `._flatten`, not a function of that name)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name):
                names.add(f.id)
            elif isinstance(f, ast.Attribute):
                names |= {f.attr, f".{f.attr}"}
    return names


def test_only_the_world_builds_a_device_mesh():
    """One owner of the parallel world (brigade/world/): no other module makes a DeviceMesh."""
    wrong = {m: sorted(_calls(p) & MESH_MAKERS) for m, p in MODULES.items()
             if not m.startswith("brigade.world")}
    assert not {m: c for m, c in wrong.items() if c}, wrong


_RANK = re.compile(r"(^|_)rank$")
_DEGREE = re.compile(r"^(dp|pp|tp|cp|ep|shard|replicas?|replicate)$")


def _names(node: ast.AST):
    for n in ast.walk(node):
        if isinstance(n, (ast.Name, ast.Attribute)):
            yield n.id if isinstance(n, ast.Name) else n.attr
        if isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", "")) == "get_rank":
            yield "rank"


def _rank_arithmetic(path: Path) -> list[str]:
    """Expressions that take a rank apart (rank // pp, rank % tp) or put one together
    ((row · pp + stage) · tp, dp_rank · pp)."""
    def rank(node):
        return any(_RANK.search(x.lower()) for x in _names(node))

    def degree(node):
        return any(_DEGREE.match(x) for x in _names(node))

    def radix(node):  # (a · degree + b): one digit of a mixed-radix rank
        return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and any(
            isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult) and degree(n) for n in ast.walk(node))

    found = []
    for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(n, ast.BinOp):
            continue
        apart = isinstance(n.op, (ast.FloorDiv, ast.Mod)) and rank(n.left)
        together = isinstance(n.op, ast.Mult) and any(
            (rank(a) or radix(a)) and degree(b) for a, b in ((n.left, n.right), (n.right, n.left)))
        if apart or together:
            found.append((n.lineno, n.col_offset, f"{n.lineno}: {ast.unparse(n)}"))
    return [text for *_, text in sorted(found)]


# Ranks onto hardware, not onto the parallel grid: which GPU a local rank drives, which node of a
# planned cluster a rank sits on.
HARDWARE = {"brigade.launcher.groups", "brigade.planner.cluster"}


def test_the_rank_finder_finds_rank_arithmetic(tmp_path):
    code = tmp_path / "m.py"
    code.write_text("a = rank // pp\nb = dist.get_rank() % tp\nc = (row * pp + stage) * tp + t\n"
                    "d = dp_rank * pp\ne = ranks * virtual\nf = rank * per\n")
    assert [line.split(":")[0] for line in _rank_arithmetic(code)] == ["1", "2", "3", "4"]


def test_only_the_world_computes_a_rank_from_coordinates_or_back():
    """brigade/world/ answers every rank ↔ coordinates question; no other module does the arithmetic."""
    wrong = {m: _rank_arithmetic(p) for m, p in MODULES.items()
             if not m.startswith("brigade.world") and m not in HARDWARE}
    assert not {m: found for m, found in wrong.items() if found}, wrong
