"""The set-up is reproducible: every tool the suite runs with is pinned to an exact version in
constraints.txt, and the set-up script (which .ci/run calls) installs with it."""

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version, f"constraints.txt: {line!r} is not NAME==VERSION"
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_every_requirement_but_torch_is_pinned_exactly():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = {_name(r) for r in project["dependencies"] + extras["dev"] + extras["hf"]
              if "python_version < '3.11'" not in r}
    pins = _pins()
    assert wanted - {"torch"} <= set(pins), f"not pinned: {sorted(wanted - {'torch'} - set(pins))}"
    assert "torch" not in pins  # setup.sh pins torch itself, so a GPU machine keeps the one it has


def test_pyproject_keeps_loose_lower_bounds_for_library_users():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "torch>=2.4" in project["dependencies"]
    assert not [r for r in project["dependencies"] if "==" in r]


def test_setup_and_ci_install_with_the_constraints():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    # the hf, float8 and data extras too: the tests build tiny Hugging Face models, convert to
    # float8 and read Parquet
    assert re.search(r"pip install .*-c constraints\.txt .*-e \"\.\[dev,hf,float8,data\]\"", setup)
    assert "torch==${BRIGADE_TORCH_VERSION:-2.13.0}" in setup
    assert "scripts/setup.sh" in (ROOT / ".ci" / "run").read_text()
    update = (ROOT / "scripts" / "update-pins.sh").read_text()
    assert '-e ".[dev,hf,float8,data]"' in update  # the next pins keep every extra the suite imports
    assert "python3 -m venv" in update and "pytest" in update and "> constraints.txt.new" in update


def test_ci_runs_the_readme_command_then_the_full_and_the_slow_tiers_as_the_pins_update_does():
    """CI runs the README's `python -m pytest` (the default tier: pyproject's addopts leave the
    full and slow tiers out), then `python -m pytest -m "full or slow"` (tests/tiers.py, and what
    measures or compiles), within one 85-minute limit; the pins update runs the same two."""
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert "-m 'not slow and not full'" in addopts
    ci = (ROOT / ".ci" / "run").read_text().split("set -euo")[1]
    assert "python3 -m pytest \"${args[@]}\"" in ci and "for step in default full-slow; do" in ci
    assert '[ "$step" = full-slow ] && args=(-m "full or slow")' in ci and "85 * 60" in ci
    assert "python -m pytest" in (ROOT / "README.md").read_text()
    update = (ROOT / "scripts" / "update-pins.sh").read_text()
    assert '-m pytest -m "full or slow"' in update

