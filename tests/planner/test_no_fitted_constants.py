"""No constant of the planner is fitted to the runs it is held against: a float in any
`brigade/planner/*.py` (a literal, or an expression of literals such as `792.1 / 989`) that equals,
to three significant figures, the ratio of two measured figures of `results/plan/published.json`
(torchtitan's tokens/s per GPU and peak GiB) fails. `compile_factor` = 5,762 / 6,667 was one.
A round number, one of two significant figures or fewer (½, 1.5, the FlashAttention-2 paper's 73 %),
is left out: among the 1,260 ratios of the 36 published figures 0.73 (62 / 84.9) and 1.5
(8,380 / 5,605) occur by chance; a constant carried to three figures or more is checked."""

import ast
import itertools
import json
import operator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLANNER = ROOT / "brigade" / "planner"
PUBLISHED = ROOT / "results" / "plan" / "published.json"
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _value(node):
    """The number an expression of numeric literals makes; None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _value(node.operand)
        return None if v is None else -v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = _value(node.left), _value(node.right)
        if a is not None and b is not None and not (isinstance(node.op, ast.Div) and b == 0):
            return _OPS[type(node.op)](a, b)
    return None


def constants(source: str) -> list[tuple[int, float]]:
    """(line, value) of every float a module states: float literals, and expressions of literals
    that make a float (an int literal alone is a count, not a fitted figure)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Constant, ast.BinOp, ast.UnaryOp)):
            v = _value(node)
            if isinstance(v, float):
                out.append((node.lineno, v))
    return out


MEASURED = ("tokens_per_s_per_gpu", "memory_gib")  # what each published row measured


def figures(data: dict) -> list[float]:
    """Every measured figure of the published table."""
    return [float(row[k]) for row in data["rows"] for k in MEASURED]


def ratios(values: list[float]) -> dict[str, tuple[float, float]]:
    """Each ratio of two distinct published figures, to three significant figures."""
    keep = sorted({v for v in values if v > 0})
    return {f"{a / b:.3g}": (a, b) for a, b in itertools.permutations(keep, 2)}


def fitted(value: float, table: dict[str, tuple[float, float]]) -> tuple[float, float] | None:
    """The two published figures whose ratio `value` is, if any (a round number aside: two
    significant figures or fewer, as ½ or 1.5)."""
    if value <= 0 or f"{value:.3g}" == f"{float(f'{value:.2g}'):.3g}":
        return None
    return table.get(f"{value:.3g}")


def test_the_check_finds_the_factor_it_was_written_for():
    table = ratios(figures(json.loads(PUBLISHED.read_text())))
    assert fitted(5762 / 6667, table) == (5762.0, 6667.0)
    assert constants("x = 0.864\ny = 5762 / 6667\nn = 8\n") == [(1, 0.864), (2, 5762 / 6667)]


@pytest.mark.parametrize("path", sorted(PLANNER.glob("*.py")), ids=lambda p: p.name)
def test_no_planner_constant_is_a_ratio_of_published_figures(path):
    table = ratios(figures(json.loads(PUBLISHED.read_text())))
    hits = [(line, v, fitted(v, table)) for line, v in constants(path.read_text(encoding="utf-8"))]
    hits = [f"line {line}: {v:.4g} = {a:g} / {b:g}" for line, v, ab in hits if ab for a, b in [ab]]
    assert not hits, f"{path.name}: constants equal to ratios of published figures: {hits}"
