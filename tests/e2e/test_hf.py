"""A user's fine-tune of a Hugging Face directory, through the CLI: `brigade train --model hf:DIR
--data FILE` starts from the directory's weights (its first validation loss is transformers'),
lowers the validation loss, resumes bit for bit after a kill, samples with the directory's
tokenizer, and `brigade export --hf` writes a directory transformers loads with the same logits.
The slow tier does the same under tensor parallel and sharding, where each rank reads only
its part of each tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.e2e.helpers import brigade, final_hash
from tests.models.hf.dirs import hf, tiny_dir

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("hf-e2e")]
RUN = ["--block-size", "32", "--batch-size", "8", "--microbatches", "2", "--max-steps", "8",
       "--snapshot-every", "2", "--eval-every", "4", "--eval-batches", "2", "--lr", "3e-3",
       "--warmup-steps", "2", "--sample-tokens", "0", "--seed", "3"]


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    from brigade.data.text import default_corpus

    path = tmp_path_factory.mktemp("text") / "notes.txt"
    path.write_text(default_corpus()[:40_000])
    return path


def _val_losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}


def _transformers_val_loss(directory: str, text: Path, cache: Path, batch_size=8,
                           eval_batches=2) -> float:
    """The run's first validation loss as transformers computes it on the same batches
    (Trainer.evaluate's: a fixed generator, `eval_batches` global batches)."""
    from brigade.data.prepared import token_data

    _, _, val = token_data(str(text), directory, 32, 0.1, str(cache))
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    g, total = torch.Generator().manual_seed(12345), 0.0
    for _ in range(eval_batches):
        x, y = val.batch(torch.randint(len(val), (batch_size,), generator=g))
        with torch.no_grad():
            total += float(torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1),
                                                             y.flatten()))
    return total / eval_batches


def _train(out, model, text, *layout):
    done = brigade("train", "--out", out, "--model", model, "--data", text, *RUN, *layout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _logits_equal_after_export(run: Path, out: Path) -> None:
    from brigade.pipeline.stages.side_inputs import whole
    from brigade.snapshot.format import resolve
    from brigade.train.export import trained_blocks

    done = brigade("export", "--hf", out, "--from", run)
    assert done.returncode == 0, done.stderr[-2000:]
    blocks, model = trained_blocks(resolve(run))
    ids = torch.randint(model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(whole(blocks).eval()(model.inputs(ids)), loaded(input_ids=ids).logits,
                                   atol=1e-5, rtol=0)
    assert transformers.AutoTokenizer.from_pretrained(out)("x = 1").input_ids


def test_fine_tune_resume_sample_and_export(tmp_path, text):
    directory = tiny_dir("llama")
    never = tmp_path / "never"
    _train(never, hf("llama"), text, "--nproc", "2", "--pp", "2", "--schedule", "zb")
    val = _val_losses(never)
    assert abs(val[0] - _transformers_val_loss(directory, text, never)) < 1e-4  # the directory's weights
    assert val[8] < val[0] - 0.1, val
    killed = tmp_path / "killed"
    _train(killed, hf("llama"), text, "--nproc", "2", "--pp", "2", "--schedule", "zb",
           "--max-restarts", "1", "--inject-fault", "kill:rank=1:step=5")
    assert final_hash(killed) == final_hash(never)
    sample = brigade("generate", "--from", never, "--prompt", "The ", "--tokens", "12")
    assert sample.returncode == 0 and sample.stdout.startswith("The ") and len(sample.stdout) > 6
    _logits_equal_after_export(never, tmp_path / "exported")
    again = brigade("export", "--hf", tmp_path / "exported", "--from", never)
    assert again.returncode == 2 and "already exists" in again.stderr
    whole = brigade("export", "--hf", tmp_path / "adapter", "--adapter", "--from", never)
    assert whole.returncode == 2
    assert "trained every weight (no --lora): export the whole model" in whole.stderr
    assert not (tmp_path / "adapter").exists()


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--nproc", "4", "--pp", "2", "--tp", "2", "--schedule", "1f1b"],
                                    ["--nproc", "2", "--shard", "2"],
                                    ["--nproc", "4", "--tp", "2", "--shard", "2"]],
                         ids=["tp2xpp2", "shard2", "tp2xshard2"])
def test_every_rank_reads_its_part_and_exports_whole(tmp_path, text, layout):
    run = tmp_path / "run"
    _train(run, hf("llama"), text, *layout)
    assert abs(_val_losses(run)[0] - _transformers_val_loss(tiny_dir("llama"), text, run)) < 1e-4
    _logits_equal_after_export(run, tmp_path / "exported")


@pytest.mark.slow
def test_gpt2_fine_tunes_under_dp_and_pp(tmp_path, text):
    run = tmp_path / "run"
    _train(run, hf("gpt2"), text, "--nproc", "2", "--pp", "2", "--schedule", "1f1b")
    val = _val_losses(run)
    assert abs(val[0] - _transformers_val_loss(tiny_dir("gpt2"), text, run)) < 1e-4 and val[8] < val[0]


def test_a_mixture_of_experts_fine_tunes_over_pp_and_ep_and_exports(tmp_path, text):
    """Qwen3-MoE (4 experts, top 2), dp 2 × pp 2 with the experts split over both replicas:
    the run starts from the directory's weights (transformers' first validation loss), lowers
    it, reports each expert's load, and the export, one tensor per expert as transformers
    stores them, gives transformers the run's last validation loss."""
    directory = tiny_dir("qwen3_moe", layers=2)
    run = tmp_path / "run"
    _train(run, hf("qwen3_moe", layers=2), text, "--nproc", "4", "--pp", "2", "--ep", "2", "--schedule", "zb")
    val = _val_losses(run)
    assert abs(val[0] - _transformers_val_loss(directory, text, run)) < 1e-4
    assert val[8] < val[0] - 0.1, val
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    load = [r["moe_load"] for r in rows if "moe_load" in r]
    assert len(load) == 8 and all(len(layer) == 4 and abs(sum(layer) - 1) < 1e-3 for layer in load[-1])
    _logits_equal_after_export(run, tmp_path / "exported")
    assert abs(val[8] - _transformers_val_loss(str(tmp_path / "exported"), text, run)) < 1e-4


def _peft_logits_equal(run: Path, out: Path) -> None:
    """`export --adapter`: a PEFT adapter folder that peft loads onto the directory's own model,
    giving the adapted blocks' logits."""
    from brigade.pipeline.stages.side_inputs import whole
    from brigade.snapshot.format import resolve
    from brigade.train.export import trained_blocks

    peft = pytest.importorskip("peft")
    done = brigade("export", "--hf", out, "--adapter", "--from", run)
    assert done.returncode == 0, done.stderr[-2000:]
    config = json.loads((out / "adapter_config.json").read_text())
    blocks, model = trained_blocks(resolve(run))
    layers = model.config.num_hidden_layers  # q, k, v, o, gate, up and down in each
    assert config["peft_type"] == "LORA" and config["r"] == 4 and len(config["target_modules"]) == 7 * layers
    base = transformers.AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    loaded = peft.PeftModel.from_pretrained(base, str(out)).eval()
    ids = torch.randint(model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(whole(blocks).eval()(model.inputs(ids)), loaded(input_ids=ids).logits,
                                   atol=1e-5, rtol=0)


@pytest.mark.slow
def test_a_mixture_sharded_over_what_ep_leaves_reads_its_part_and_exports_whole(tmp_path, text):
    """dp 4, --shard 4 --ep 2: each process reads its 2 experts' rows of its edp shard (a 2-D
    DTensor) straight from the per-expert tensors on disk."""
    run = tmp_path / "run"
    _train(run, hf("qwen3_moe", layers=2), text, "--nproc", "4", "--shard", "4", "--ep", "2")
    want = _transformers_val_loss(tiny_dir("qwen3_moe", layers=2), text, run)
    assert abs(_val_losses(run)[0] - want) < 1e-4
    _logits_equal_after_export(run, tmp_path / "exported")


@pytest.mark.full
@pytest.mark.parametrize("layout", [["--nproc", "2", "--tp", "2"], ["--nproc", "2", "--shard", "2"]],
                         ids=["tp2", "shard2"])
def test_a_lora_fine_tune_starts_at_the_directory_and_exports_merged(tmp_path, text, layout):
    """--lora 4 on the llama's projections (B zero: the first validation loss is transformers'),
    each rank reading its part of the frozen base; the loss falls, the snapshot holds the
    adapters alone, and the export folds them into the weights transformers loads, with the
    logits of the adapted blocks."""
    run = tmp_path / "run"
    _train(run, hf("llama"), text, *layout, "--lora", "4", "--lr", "1e-2")
    val = _val_losses(run)
    assert abs(val[0] - _transformers_val_loss(tiny_dir("llama"), text, run)) < 1e-4
    assert val[8] < val[0] - 0.05, val
    _logits_equal_after_export(run, tmp_path / "exported")
    assert abs(val[8] - _transformers_val_loss(str(tmp_path / "exported"), text, run)) < 1e-4
    _peft_logits_equal(run, tmp_path / "adapter")


def test_packed_documents_resume_bit_for_bit_after_a_kill(tmp_path):
    """A corpus of many short documents, so that windows pack several (attention within each,
    positions restarting: docs/data.md#documents-in-a-window): a run killed at step 5 resumes
    from its snapshot to the same final weights as the run never killed (the loader's cursor is
    the windows', which the masks do not change)."""
    corpus = tmp_path / "notes.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"note {k}: " + "word " * (k % 17)}) + "\n"
                              for k in range(600)))
    never, killed = tmp_path / "never", tmp_path / "killed"
    _train(never, hf("llama"), corpus, "--nproc", "2", "--pp", "2")
    _train(killed, hf("llama"), corpus, "--nproc", "2", "--pp", "2", "--max-restarts", "1",
           "--inject-fault", "kill:rank=1:step=5")
    assert final_hash(killed) == final_hash(never)
    from brigade.data.prepared import token_data

    _, train, _ = token_data(str(corpus), tiny_dir("llama"), 32, 0.1, str(never), documents=True)
    assert int(train.batch(torch.arange(8))[2].max()) >= 1  # the windows do pack documents
