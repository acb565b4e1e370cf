"""`--model hf:DIR` on the commands that measure and predict: bench, tune and plan take the
standalone cut of the same layers (no side inputs: torch.distributed.pipelining hands each stage
one tensor), and the tuner's chosen configuration trains the directory."""

from __future__ import annotations

import json

import pytest

from tests.e2e.helpers import brigade
from tests.models.hf.dirs import hf

pytest.importorskip("transformers")
# They measure (10-20 s each): the slow tier, with the other benchmarks' and the tuner's commands.
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_plan_ranks_layouts_of_a_directory(cli):
    done = cli("plan", "--model", hf("llama"), "--nodes", "1", "--gpus-per-node", "8", "--device", "h100",
               "--batch-size", "32", "--seq-len", "64", "--recompute", "none", "--json")  # one mode measured
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["rows"]
    assert len(rows) > 10 and all(r["fits"] for r in rows[:3])


def test_tune_chooses_a_layout_that_trains_the_directory(tmp_path):
    done = brigade("tune", "--model", hf("llama"), "--quick", "--repeats", "1", "--batch-size", "4",
                   "--splits", "2", "--schedules", "1f1b", "--out", tmp_path / "tune")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f'model = "{hf("llama")}"' in (tmp_path / "tune" / "tune.toml").read_text()
    run = brigade("train", "--config", tmp_path / "tune" / "tune.toml", "--max-steps", "2", "--sample-tokens",
                  "0", "--eval-every", "100", "--out", tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
