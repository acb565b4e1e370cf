"""brigade.results.published: torchtitan's Llama 3.1 H100 rows planned from config alone, beside what
was measured; the committed figures are the script's, and docs/plan.md quotes its table."""

import json
import re
from pathlib import Path

from brigade.results.published import GOAL, PUBLISHED, main, table

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_rows_are_planned_beside_the_published_figures(tmp_path):
    assert main(["--tiny", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "published_vs_planned.json").read_text())
    assert (tmp_path / "published_vs_planned.png").stat().st_size > 0
    assert len(result["rows"]) == 2 and result["source"]["path"].endswith("llama3_h100_202412_torchtitan.md")
    for r in result["rows"]:
        assert r["planned_tokens_per_s_per_gpu"] > 0 and r["planned_reserved_gib"] >= r["planned_allocated_gib"]
        assert r["tokens_error"] == r["planned_tokens_per_s_per_gpu"] / r["published_tokens_per_s_per_gpu"] - 1


def test_every_published_row_is_planned_and_each_miss_says_what_is_missing():
    published = json.loads(PUBLISHED.read_text())
    assert published["source"]["commit"] and len(published["rows"]) == 18  # tables 1-6 of the page
    result = json.loads((ROOT / "results" / "plan" / "published_vs_planned.json").read_text())
    assert result["command"] == "python -m brigade.results.published"
    assert [(r["table"], r["label"]) for r in result["rows"]] == [(r["table"], r["label"]) for r in published["rows"]]
    for r in result["rows"]:
        if abs(r["tokens_error"]) > GOAL or abs(r["memory_error"]) > GOAL:
            assert r["missing"], r["label"]


def test_docs_plan_quotes_the_committed_table():
    result = json.loads((ROOT / "results" / "plan" / "published_vs_planned.json").read_text())
    page = (ROOT / "docs" / "plan.md").read_text()
    block = re.search(r"<!-- published -->\n(.*?)\n<!-- /published -->", page, re.S).group(1)
    assert block == "\n".join(table(result["rows"]))
