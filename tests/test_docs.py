"""The README and docs/ stay true: the schedules page is what its script writes from the registry
now, every grid a page shows is what `brigade schedule` draws, the README is one screen that links
every page, and every link, anchor and module a page names exists.

(That every command on a page runs is tests/e2e/test_readme.py; that every figure of the results
table comes from results/ is tests/test_results.py.)
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
README_MAX_LINES = 220  # "The README is one screen" (the design notes, rule 12): the rest lives in docs/


def _schedules_doc():
    spec = importlib.util.spec_from_file_location("schedules_doc", ROOT / "scripts" / "schedules_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_schedules_page_is_what_its_script_writes_from_the_registry():
    doc = _schedules_doc()
    assert doc.PAGE.read_text(encoding="utf-8") == doc.page(), (
        "docs/schedules.md is out of date (a schedule was added or changed): run "
        "`python scripts/schedules_doc.py` and commit the page")


def test_the_schedules_page_has_every_registered_schedule_in_its_table_and_a_grid():
    from brigade.pipeline.plans.schedule import SCHEDULES

    text = (ROOT / "docs" / "schedules.md").read_text(encoding="utf-8")
    for name in SCHEDULES:
        assert text.count(f"| `{name}`") == 2, name  # the registry's table and the costs' table
        assert f"### `{name}`\n" in text, name


def test_a_schedule_registered_later_appears_on_the_page(monkeypatch):
    from brigade.pipeline.plans import schedule

    doc = _schedules_doc()
    added = schedule.Schedule("gpipe-again", schedule.gpipe, "GPipe under another name")
    monkeypatch.setitem(schedule.SCHEDULES, added.name, added)
    page = doc.page()
    assert "| `gpipe-again` | single | 1 | whole (B) | GPipe under another name |" in page
    assert "### `gpipe-again`" in page and "no closed form written" in page
    assert page != (ROOT / "docs" / "schedules.md").read_text(encoding="utf-8")


def test_each_grid_of_the_schedules_page_is_what_brigade_schedule_draws(cli):
    from brigade.pipeline.plans.schedule import SCHEDULES

    doc = _schedules_doc()
    for name in SCHEDULES:
        result = cli("schedule", "--schedule", name, "--stages", doc.RANKS,
                     "--microbatches", doc.MICROBATCHES)
        assert result.returncode == 0, result.stderr
        assert doc.grid(name) in result.stdout, name


def _typed_blocks(text: str) -> list[tuple[str, str]]:
    """(command, the output shown under it) for each code block that starts with `$ brigade schedule`."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    typed = [b.split("\n", 1) for b in blocks if b.startswith("$ brigade schedule ")]
    return [(first.removeprefix("$ "), rest) for first, rest in typed]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_a_pages_brigade_schedule_output_is_what_the_command_prints(page, cli):
    for command, shown in _typed_blocks(page.read_text(encoding="utf-8")):
        result = cli(*command.split()[1:])
        assert result.returncode == 0, result.stderr
        assert result.stdout == shown, f"{page.name}: `{command}` prints\n{result.stdout}"


def test_readme_draws_a_grid():
    assert _typed_blocks(README.read_text(encoding="utf-8"))


def test_the_readme_is_one_screen_and_links_every_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES, (
        f"README.md has {len(text.splitlines())} lines, more than {README_MAX_LINES}: move the detail "
        "to a page of docs/ and link it")
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    for page in DOCS:
        if page.name != "README.md":
            assert f"(docs/{page.name})" in text, f"the README does not link docs/{page.name}"
            assert f"({page.name})" in index, f"docs/README.md does not link {page.name}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_of_a_page_leads_somewhere(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: link to {target}: no such file"
        if anchor:
            assert anchor in _anchors(dest), f"{page.name}: link to {target}: {dest.name} has no such heading"


def _named_modules(text: str) -> set[str]:
    """The .py and .sh files a page names: `pipeline/plans/validate.py`, `host/net.py`, scripts/results.sh."""
    return set(re.findall(r"(?<![\w/.])((?:[\w-]+/)*[\w-]+\.(?:py|sh))\b(?![:\w])", text)) - {"file.py"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_module_a_page_names_exists(page):
    here = {p.relative_to(ROOT).as_posix() for top in ("brigade", "tests", "scripts", "examples")
            for p in (ROOT / top).rglob("*") if p.suffix in (".py", ".sh")}
    for name in _named_modules(page.read_text(encoding="utf-8")):
        found = (name in here or f"brigade/{name}" in here
                 or ("/" not in name and any(h.endswith(f"/{name}") for h in here)))
        assert found, f"{page.name} names {name}, which is not in the checkout: fix the page"


def test_the_testing_pages_figures_are_what_scripts_durations_writes_from_results():
    """docs/testing.md's tiers block (tests per tier, wall times, the slowest tests) is rendered
    from results/testing/ by scripts/durations.py; a hand edit of the block or a stale file fails."""
    spec = importlib.util.spec_from_file_location("durations", ROOT / "scripts" / "durations.py")
    durations = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(durations)
    assert durations.refresh_page(check=True), \
        "docs/testing.md's tiers block differs from results/testing/: run `python scripts/durations.py --tiers`"



def test_the_testing_pages_mutation_figures_are_the_committed_summarys():
    """docs/testing.md's mutation figures (the totals, the equivalent and killed-since survivors,
    generate.py's and costs.py's counts, the last run's seconds) are results/mutation/summary.json's."""
    import json

    summary = json.loads((ROOT / "results" / "mutation" / "summary.json").read_text())
    text = " ".join((ROOT / "docs" / "testing.md").read_text().split())
    survivors = [s for m in summary["modules"].values() for s in m["survivors"]]
    since = sum(s["reason"].startswith("killed since") for s in survivors)
    wants = [f"{summary['mutants']} mutants, {summary['killed']} killed, {summary['timeout']} timed out",
             f"{summary['survived']} survived: {summary['survived'] - since} judged equivalent, and {since} ",
             f"took {summary['seconds']} s"]
    for name in ("generate", "costs"):
        m = summary["modules"][f"brigade/pipeline/plans/{name}.py"]
        wants.append(f"`{name}.py` ({m['mutants']} mutants, " + (
            f"{m['killed']} killed, {m['survived']} survived" if m["survived"] else "all killed"))
    for want in wants:
        assert want in text, f"docs/testing.md does not say {want!r} (results/mutation/summary.json)"
