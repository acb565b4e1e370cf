"""The tiers (tests/tiers.py): every case is in exactly one, each grid named in FULL keeps its
representatives in the default tier and leaves the rest to the full tier, nothing in FULL is
stale, and the counts per tier in results/testing/tiers.json (which docs/testing.md shows) are
those of the suite as it is.

One collection of the whole suite (`-m ""`, ~12 s) in a process of its own serves every check.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest

from tests import tiers
from tests.test_gpu_tier import GPU_TESTS

ROOT = Path(__file__).resolve().parents[1]
COUNTS = ROOT / "results" / "testing" / "tiers.json"
_spec = importlib.util.spec_from_file_location("durations", ROOT / "scripts" / "durations.py")
durations = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(durations)


# One worker runs them all, on one collection: each worker would otherwise collect the suite
# (a session fixture: xdist interleaves modules on a worker, and a module's would be made again).
pytestmark = pytest.mark.xdist_group("tiers")


@pytest.fixture(scope="session")
def collected() -> dict[str, str]:
    """{node id: tier} for every case of the suite, as `--tiers-report` writes it."""
    return durations.collect()


def test_an_id_splits_into_its_file_its_test_and_its_case():
    assert tiers.split_id("tests/a.py::test_b[x-y]@world") == ("tests/a.py", "tests/a.py::test_b", "x-y")
    assert tiers.split_id("tests/a.py::test_b") == ("tests/a.py", "tests/a.py::test_b", "")
    assert tiers.clean("tests/a.py::test_b[pp2-zb]@pp2") == "tests/a.py::test_b[pp2-zb]"


@pytest.mark.timeout(200)
def test_every_entry_of_full_names_collected_cases_and_keeps_its_representatives(collected):
    for key, kept in tiers.FULL.items():
        cases = {tiers.split_id(nodeid)[2]: tier for nodeid, tier in collected.items()
                 if tiers.entry(nodeid) == key}
        assert cases, f"tests/tiers.py: FULL names {key}, which no longer exists"
        for pattern in kept:
            chosen = [case for case in cases if fnmatch.fnmatchcase(case, pattern)]
            assert chosen, f"tests/tiers.py: {key}: no case matches {pattern!r} (of {sorted(cases)})"
            assert {cases[case] for case in chosen} == {"default"}, (key, pattern)
        rest = {tier for case, tier in cases.items() if not any(fnmatch.fnmatchcase(case, p) for p in kept)}
        assert rest and rest <= {"full", "slow"}, f"{key}: the cases left to the full tier are in {rest}"


@pytest.mark.timeout(200)
def test_each_case_is_in_one_tier_and_the_gpu_tier_is_its_tests(collected):
    assert set(collected.values()) <= set(tiers.TIERS)
    assert sorted(nodeid for nodeid, tier in collected.items() if tier == "cuda") == GPU_TESTS


@pytest.mark.timeout(200)
def test_the_counts_per_tier_in_results_are_the_suites(collected):
    """results/testing/tiers.json is written by `python scripts/durations.py --tiers`; rerun it
    when a test is added or moved."""
    counts = json.loads(COUNTS.read_text())["tests"]
    assert counts == dict(sorted(Counter(collected.values()).items())), \
        "results/testing/tiers.json is stale: run `python scripts/durations.py --tiers`"


def _mutation_selection() -> tuple[list[str], list[str]]:
    """The paths scripts/mutation.sh runs against each mutant, and the node ids it deselects."""
    lines = (ROOT / "scripts" / "mutation.sh").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "pytest_add_cli_args_test_selection" in line)
    args = []
    for line in lines[start + 1:]:
        if not line.strip().startswith('echo "    '):
            break
        args.append(line.strip().removeprefix('echo "').removesuffix('"').strip())
    paths = [a for a in args if not a.startswith("--")]
    return paths, [a.split("=", 1)[1] for a in args if a.startswith("--deselect=")]


@pytest.mark.timeout(200)
def test_the_tests_that_catch_mutants_are_all_in_the_default_tier(collected):
    """scripts/mutation.sh counts the mutants its tests catch: none of those tests may leave the
    default tier, so the faster suite catches every mutant the mutation run counts as caught."""
    paths, deselected = _mutation_selection()
    assert paths, "scripts/mutation.sh: no test selection found"
    chosen = {nodeid: tier for nodeid, tier in collected.items()
              if any(nodeid.startswith(p) for p in paths) and nodeid not in deselected}
    assert chosen, paths
    assert {nodeid for nodeid, tier in chosen.items() if tier != "default"} == set()
