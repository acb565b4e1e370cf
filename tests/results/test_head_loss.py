"""brigade.results.head_loss: one row measured in this process, and the committed figures
(docs/memory.md and docs/results.md quote them). Its whole run, --tiny, is docs/memory.md's
command in tests/e2e/test_readme.py."""

import json
from pathlib import Path

import pytest
import torch

from brigade.results import head_loss

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.full  # a process of its own: 8 s
def test_a_row_measures_bytes_and_the_chunked_loss_equals_the_plain_one():
    """The plain row in a fresh process, as the script measures it (in a long-lived test worker
    the logits may come from memory already resident, and the peak not move); the chunked row
    here, its loss the plain one's."""
    plain = head_loss.measure_apart(4096, 256, 64, 0)  # logits 4 MiB, their gradient as much
    threads = torch.get_num_threads()
    try:
        chunked = head_loss.measure(4096, 256, 64, 64)
    finally:
        torch.set_num_threads(threads)
    assert plain["peak_bytes"] > 4 * 2**20 and chunked["chunk"] == 64
    assert abs(plain["loss"] - chunked["loss"]) <= 1e-6


def test_the_committed_peaks_at_the_issues_size():
    result = json.loads((ROOT / "results" / "head-loss" / "head_loss.json").read_text())
    assert result["command"] == "python -m brigade.results.head_loss"
    assert (result["vocab"], result["seq"], result["batch"]) == (128_256, 4096, 1)
    plain, *chunked = result["rows"]
    assert plain["chunk"] == 0 and [r["chunk"] for r in chunked] == [2048, 1024, 512]
    # the plain loss holds the logits about three times over (logits, softmax, gradient)
    assert plain["peak_bytes"] >= 2.5 * result["logits_bytes"]
    default = next(r for r in chunked if r["chunk"] == 1024)  # --loss-chunk's default
    assert default["peak_bytes"] <= 0.5 * plain["peak_bytes"]
    assert [r["peak_bytes"] for r in chunked] == sorted((r["peak_bytes"] for r in chunked), reverse=True)
    assert result["max_abs_loss_diff"] <= 1e-5
