"""`brigade train --lora` as a user runs it: snapshots that hold the adapters alone, a resume that
ends bit-identical to a run never stopped, under pp 2; `generate` and `eval` read the adapters;
bad input is one line before any process starts."""

import json
from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from tests.e2e.helpers import TINY, brigade, final_hash, train

LORA = ["--lora", "4", "--lora-alpha", "8", "--nproc", "2", "--pp", "2", "--decay-steps", "6"]


def _snapshot(out: Path) -> Path:
    return out / "snapshots" / (out / "snapshots" / "LATEST").read_text().strip()


@pytest.mark.full
@pytest.mark.timeout(300)
def test_lora_snapshots_hold_the_adapters_and_resume_bit_identical(tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    done = train(straight, *LORA, "--max-steps", "6", "--snapshot-every", "0")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    first = train(stopped, *LORA, "--max-steps", "3", "--snapshot-every", "0")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    again = train(stopped, *LORA, "--max-steps", "6", "--snapshot-every", "0")
    assert again.returncode == 0 and "resum" in again.stdout, again.stdout[-3000:] + again.stderr[-3000:]
    assert final_hash(stopped) == final_hash(straight)
    stored = FileSystemReader(str(_snapshot(straight))).read_metadata().state_dict_metadata
    weights = [k for k in stored if k.startswith("model.")]
    assert weights and all(k.endswith((".lora_a", ".lora_b")) for k in weights), weights
    optimized = [k for k in stored if k.startswith("optim.state.")]  # optim.state.NAME.exp_avg
    assert optimized and all(".lora_a." in k or ".lora_b." in k for k in optimized), optimized
    # generate and eval load the base from the seed and the adapters from the snapshot
    assert brigade("generate", "--from", straight, "--tokens", "10").returncode == 0
    scored = brigade("eval", "--from", straight, "--json", "--batches", "2")
    assert scored.returncode == 0, scored.stdout[-2000:] + scored.stderr[-2000:]
    assert json.loads(scored.stdout)["step"] == 6


@pytest.mark.parametrize("flags,message", [
    (["--lora", "0"], "--lora 0: the adapters' rank must be ≥ 1 (8 or 16 are usual); leave --lora out"),
    (["--lora", "-1"], "--lora -1: the adapters' rank must be ≥ 1 (8 or 16 are usual); 0 trains "
                       "every weight"),
    (["--lora", "4", "--lora-targets", "wq"], "--lora-targets wq: 'wq' names no linear layer of the model's "
                                              "blocks; they have: attn.proj, attn.qkv, mlp.0, mlp.2, out"),
])
def test_bad_lora_settings_are_one_line_before_any_process(tmp_path, capsys, flags, message):
    from brigade.cli import main

    assert main(["train", "--out", str(tmp_path / "out"), *TINY, *flags, "--max-steps", "2",
                 "--nproc", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("brigade train: error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out" / "snapshots").exists()


def _val_losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in rows if "val_loss" in r]


@pytest.mark.full
@pytest.mark.timeout(300)
def test_lora_trains_in_bf16_under_fsdp2_as_in_fp32(tmp_path):
    """--precision bf16 --shard 2: FSDP2 gathers the frozen weights and the adapters in bf16 and
    reduce-scatters the adapters' gradients in fp32; the validation losses follow fp32's within
    0.05 (bf16's rounding), and fall."""
    runs = {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        done = train(out, "--lora", "4", "--nproc", "2", "--shard", "2", "--max-steps", "20",
                     "--eval-every", "10", "--precision", precision, "--lr", "1e-2", "--sample-tokens", "0")
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        runs[precision] = _val_losses(out)
    assert len(runs["bf16"]) == len(runs["fp32"]) == 3
    assert all(abs(a - b) < 0.05 for a, b in zip(runs["bf16"], runs["fp32"])), runs
    assert runs["bf16"][-1] < runs["bf16"][0], runs
