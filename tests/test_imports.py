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
  counting imports inside functions and under TYPE_CHECKING too.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "brigade"


def _module(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


MODULES = {_module(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path) -> set[str]:
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
              "brigade.check", "brigade.cli", "brigade.launch.agent")
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


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
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


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    graph = {m: _imports(m, p) for m, p in MODULES.items()}
    assert _circles(graph) == []
