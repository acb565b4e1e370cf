"""brigade.results.long_context: Llama 3.1 at long sequences planned from its config.json alone, cp
among the layouts, the best layout beside the best without cp and the best pipeline without cp;
and the committed figures are the script's (docs/plan.md quotes its table)."""

import json
from pathlib import Path

import pytest

from brigade.results.long_context import CHOICES, GPUS, SEQUENCES, main, markdown

pytest.importorskip("transformers", reason="the hf extra (scripts/setup.sh installs it)")
ROOT = Path(__file__).resolve().parents[2]


def test_the_tiny_run_writes_its_json_plot_and_table(tmp_path):
    assert main(["--tiny", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "long_context.json").read_text())
    assert (tmp_path / "long_context.png").stat().st_size > 0
    assert (tmp_path / "long_context.md").read_text() == markdown(result)
    assert [(c["gpus"], c["seq_len"], c["batch_size"]) for c in result["cases"]] == [(8, 64, 16), (8, 128, 8)]
    for c in result["cases"]:
        assert c["cp_layouts"] > 0 and c["cp_method"] == "ring"
        assert c["best_without_cp"]["layout"]["cp"] == 1 and c["best_pipeline_without_cp"]["layout"]["pp"] > 1
        assert c["best"]["step_s"] <= c["best_without_cp"]["step_s"]  # ranked: the first is the fastest fit


def test_the_committed_plan_is_llama_3_1_8b_and_fits_131072_with_cp():
    result = json.loads((ROOT / "results" / "plan" / "long_context.json").read_text())
    assert result["command"] == "python -m brigade.results.long_context" and result["model"] == "Llama 3.1 8B"
    assert [(c["gpus"], c["seq_len"]) for c in result["cases"]] == [(g, s) for g in GPUS for s in SEQUENCES]
    assert (ROOT / "results" / "plan" / "long_context.md").read_text() == markdown(result)
    for c in result["cases"]:
        assert all(c[name] is not None for name in CHOICES)
        if c["seq_len"] == 131072:
            assert c["best"]["fits"] and c["best"]["layout"]["cp"] > 1
            assert c["best"]["memory_gib"]["peak"] < 80e9 / 2**30
            # where a pipeline without cp fits, cp is ranked ahead of it: faster
            pipe = c["best_pipeline_without_cp"]
            assert not pipe["fits"] or pipe["step_s"] > c["best"]["step_s"]
