"""brigade.results.moe_plan: a mixture of experts planned from its config.json alone, its layouts
ranked with ep among them, the best at each ep, the parameters in all against active; and the
committed Qwen3-30B-A3B figures are the script's (docs/plan.md quotes them)."""

import json
from pathlib import Path

import pytest

from brigade.results.moe_plan import QWEN3_30B_A3B, main

pytest.importorskip("transformers", reason="the hf extra (scripts/setup.sh installs it)")
ROOT = Path(__file__).resolve().parents[2]


def test_the_tiny_run_ranks_layouts_with_ep_and_writes_its_json_and_plot(tmp_path):
    assert main(["--tiny", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "moe_plan.json").read_text())
    assert (tmp_path / "moe_plan.png").stat().st_size > 0
    assert [r["layout"]["ep"] for r in result["by_ep"]] == [1, 2, 4, 8]  # 8 experts: ep up to 8 of dp 16
    steps = [r["step_s"] for r in result["rows"]]
    assert steps == sorted(steps) and result["best"] == result["rows"][0]
    p = result["parameters"]
    assert p["experts"] == [8] and p["top_k"] == [2] and p["active"] < p["total"]
    assert all(r["all_to_all_s"] > 0 for r in result["by_ep"][1:]) and result["by_ep"][0]["all_to_all_s"] == 0


def test_the_committed_plan_is_qwen3_30b_a3b_on_16_h100s():
    result = json.loads((ROOT / "results" / "plan" / "moe_plan.json").read_text())
    assert result["command"] == "python -m brigade.results.moe_plan" and result["gpus"] == 16
    assert result["config"]["num_experts"] == QWEN3_30B_A3B["num_experts"] == 128
    assert 30e9 < result["parameters"]["total"] < 31e9  # published: 30.5 B in all, 3.3 B active
    assert 3.2e9 < result["parameters"]["active"] < 3.4e9
    assert {r["layout"]["ep"] for r in result["by_ep"]} == {1, 2, 4, 8, 16}
