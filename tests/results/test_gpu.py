"""The GPU figures' arithmetic (the measurement itself needs a GPU: scripts/gpu-check.sh)."""

import subprocess
import sys

import pytest
import torch

from brigade.results.gpu import flops_per_token, peak_flops


def test_flops_per_token_counts_weights_and_attention():
    # 6 FLOPs per parameter per token (forward 2, backward 4) plus 12·L·T·C for attention scores.
    assert flops_per_token(1_000, n_layer=2, context=8, n_embd=4) == 6_000 + 12 * 2 * 8 * 4


def test_peak_flops_by_name_and_override(monkeypatch):
    monkeypatch.delenv("BRIGADE_PEAK_TFLOPS", raising=False)
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("Some Future GPU") is None
    monkeypatch.setenv("BRIGADE_PEAK_TFLOPS", "100")
    assert peak_flops("Some Future GPU") == 100e12


@pytest.mark.skipif(torch.cuda.is_available(), reason="this case is about a machine without a GPU")
def test_without_a_gpu_one_line_and_non_zero_exit():
    r = subprocess.run([sys.executable, "-m", "brigade.results.gpu"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "no GPU is visible" in r.stderr and "Traceback" not in r.stderr
