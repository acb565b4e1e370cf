"""brigade against torchtitan (scripts/gpu-compare.sh): everything but the GPU runs themselves.

Here, without torchtitan: the shape brigade builds (1,235,814,400 parameters), the runs' command
lines, the directory and text a run trains on (a tiny model of the same kind trained by the run's
own `brigade train` line), both sides' figures from what they log (brigade's from a real run,
torchtitan's from lines in its 0.3.0 format), the JSON's ratios and summary, the one-line errors.
With torchtitan, in the environment the script makes (the script run once, as a user runs it on a
machine without a GPU): the check's failures, and the stand-in that lets a CPU import its model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from brigade.errors import BrigadeError
from brigade.results import gpu_compare as gc
from brigade.results import gpu_compare_model as gm
from brigade.results import titan

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-compare.sh"
LLAMA_3_2_1B = 1_235_814_400  # Llama 3.2 1B's published parameter count, torchtitan's "1B" flavor's too
# A model of SHAPE's kind small enough to train here (the tokenizer has 257 ids).
TINY = {**gm.SHAPE, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "ffn_dim": 128,
        "vocab_size": 320, "context": 256, "rope_original_context": 64}

# torchtitan 0.3.0's step lines (components/metrics.py's format, after its logger's prefix): colours
# off, as the comparison runs it; colours on; float8 (no MFU); validation, which is no training step.
PREFIX = "[titan] 2026-12-04 05:40:02,118 - root - INFO - "
TITAN_LOG = "\n".join([
    PREFIX + "torchtitan version: 0.3.0 (0.0.0 means __version__ is not defined correctly).",
    PREFIX + "step:  1  loss: 12.03340  grad_norm:  5.6120  memory: 38.52GiB(27.23%)  tps: 1,204  "
             "tflops: 9.88  mfu: 1.00%",
    PREFIX + "\x1b[31mstep:  2  \x1b[32mloss: 11.50000  \x1b[33mgrad_norm:  4.0000  \x1b[36mmemory: "
             "40.00GiB(28.28%)  \x1b[34mtps: 40,000  \x1b[36mtflops: 328.00  \x1b[35mmfu: 33.16%\x1b[39m",
    PREFIX + "step:  3  loss: 11.00000  grad_norm:  3.0000  memory: 39.00GiB(27.57%)  tps: 20,000  "
             "tflops: 164.00  mfu: N/A",
    PREFIX + "validate step:  3  loss:  10.9000  memory: 45.00GiB(31.81%)  tps: 90,000",
])


def test_torchtitan_step_lines_are_read_colours_or_not():
    steps = titan.read_log(TITAN_LOG)
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[1] == {"step": 2, "loss": 11.5, "tokens_per_s": 40_000.0, "tflops": 328.0,
                        "mfu": pytest.approx(0.3316), "reserved_gib": 40.0}
    assert steps[2]["mfu"] is None and steps[0]["tokens_per_s"] == 1204.0


def test_torchtitan_figures_time_the_steps_after_the_warmup():
    figures = gc.titan_figures(TITAN_LOG, warmup=1)
    # steps 2 and 3, the same tokens each: tokens ÷ time is the harmonic mean of their rates
    assert figures["tokens_per_s"] == pytest.approx(2 / (1 / 40_000 + 1 / 20_000))
    assert figures["steps_timed"] == 2
    assert figures["own_peak_gib"] == 40.0  # the validation's 45 is not a training step's
    assert figures["own_mfu"] is None and figures["final_loss"] == 11.0  # step 3's float8 line has none
    assert gc.titan_figures(TITAN_LOG, warmup=0)["own_mfu"] is None
    with pytest.raises(BrigadeError, match="none to time after a warm-up of 3"):
        gc.titan_figures(TITAN_LOG, warmup=3)


def test_brigade_figures_from_a_real_run(tiny_run):
    from brigade.train.metrics import events, read_records, training

    records = read_records(tiny_run)
    steps = {r["step"]: r for r in training(records)}
    figures = gc.brigade_figures(tiny_run, warmup=2)
    tokens = sum(steps[s]["tokens_per_s"] * steps[s]["step_time_s"] for s in (3, 4, 5, 6))
    assert figures["tokens_per_s"] == pytest.approx(tokens / (steps[6]["time"] - steps[2]["time"]))
    assert figures["steps_timed"] == 4 and figures["final_loss"] == steps[6]["loss"]
    assert figures["own_peak_gib"] == events(records, "memory")[0]["rank0/peak"] / 2**30 > 0
    with pytest.raises(BrigadeError, match="too few to time after a warm-up of 6"):
        gc.brigade_figures(tiny_run, warmup=6)


def test_side_by_side_adds_mfu_and_divides_brigade_by_torchtitan():
    ours = {"tokens_per_s": 30_000.0, "peak_memory_gib": 50.0}
    theirs = {"tokens_per_s": 20_000.0, "peak_memory_gib": 40.0}
    run = gc.side_by_side(ours, theirs, LLAMA_3_2_1B, 989e12)
    per_token = 6 * LLAMA_3_2_1B + 12 * 16 * 2048 * 2048
    assert ours["mfu"] == pytest.approx(per_token * 30_000 / 989e12)
    assert run["ratio"] == {"tokens_per_s": 1.5, "mfu": pytest.approx(1.5), "peak_memory_gib": 1.25}
    broken = gc.side_by_side({"error": "exit 1: boom", "log": "b.log"}, dict(theirs), LLAMA_3_2_1B, None)
    assert broken["ratio"] == {"tokens_per_s": None, "mfu": None, "peak_memory_gib": None}
    assert broken["torchtitan"]["mfu"] is None  # no peak known for the GPU: no MFU
    result = {"runs": {"bf16": run, "float8": broken, "fp4": {"skipped": "not a mode"}}}
    lines = gc.summary(result)
    assert lines[0] == ("bf16: brigade vs torchtitan: tokens/s/GPU 30,000 vs 20,000 (x1.500), MFU "
                        f"{ours['mfu']:.1%} vs {theirs['mfu']:.1%}, peak memory 50.0 vs 40.0 GiB (x1.250)")
    assert lines[1] == "float8: brigade failed: exit 1: boom (see b.log)" and "(x-)" in lines[2]
    assert lines[3] == "fp4: not run: not a mode"
    assert gc.failed(result) and not gc.failed({"runs": {"bf16": run}})


def llama_parameters(shape: dict) -> int:
    """A Llama's parameter count from its shape alone (no module built): per block the query and
    output projections (dim × heads × head_dim each), key and value (dim × kv heads × head_dim
    each), the gated feed-forward's three (dim × ffn), two norms; the embedding (the head too, when
    tied) and the final norm. No biases: Llama has none."""
    d, q, kv = shape["dim"], shape["n_heads"] * shape["head_dim"], shape["n_kv_heads"] * shape["head_dim"]
    block = 2 * d * q + 2 * d * kv + 3 * d * shape["ffn_dim"] + 2 * d
    embeddings = shape["vocab_size"] * d * (1 if shape["tied"] else 2)
    return shape["n_layers"] * block + embeddings + d


def test_the_count_of_the_shape_is_llama_3_2_1b_published_count():
    assert llama_parameters(gm.SHAPE) == LLAMA_3_2_1B
    untied = llama_parameters({**TINY, "tied": False})
    assert untied == llama_parameters(TINY) + TINY["vocab_size"] * TINY["dim"]  # a head of its own


def test_the_shape_is_the_llama_brigade_builds_from_config_json(tmp_path):
    gm.hf_config().save_pretrained(tmp_path)
    shape, params = gm.brigade_model(tmp_path)
    assert shape == gm.SHAPE and params == LLAMA_3_2_1B


def test_differences_say_which_side_and_what_was_wanted():
    theirs = {**gm.SHAPE, "ffn_dim": 8064}
    assert gm.differences(gm.SHAPE, dict(gm.SHAPE), theirs) == [
        "ffn_dim 8192 (brigade) vs 8064 (torchtitan), wanted 8192"]
    assert gm.differences(gm.SHAPE, dict(gm.SHAPE), dict(gm.SHAPE)) == []


def test_the_runs_command_lines(tmp_path):
    argv = gc.brigade_argv("float8", tmp_path / "m", tmp_path / "t.jsonl", 40, 4, tmp_path / "o")
    assert argv[:3] == ["-m", "brigade", "train"] and argv[-2:] == ["--float8", "rowwise"]
    assert "--compile" in argv
    assert "--float8" not in gc.brigade_argv("bf16", tmp_path, tmp_path, 40, 4, tmp_path)
    flags = titan.flags(40, 4, "M", "T", "D")
    line = titan.argv("float8", flags)
    assert line[:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m",
                        "torchtitan.train"]
    assert line[7:11] == ["--module", "brigade.results.titan", "--config", "compare_float8"]
    assert line[11:] == flags == ["--training.steps", "40", "--training.local_batch_size", "4",
                                  "--hf_assets_path", "M", "--dataloader.dataset_path", "T",
                                  "--dump_folder", "D"]


@pytest.mark.parametrize("mode", titan.MODES)
def test_brigade_train_accepts_the_runs_command_line(mode, tmp_path, capsys):
    from brigade.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    printed = capsys.readouterr().out  # read once: a second read returns nothing (it once skipped float8)
    flags = ["--compile"] + (["--float8"] if mode == "float8" else [])
    assert not [flag for flag in flags if flag not in printed], "the GPU run's flags must be brigade train's"
    argv = gc.brigade_argv(mode, tmp_path / "m", tmp_path / "t.jsonl", 40, 4, tmp_path / "o")
    args = build_parser().parse_args(argv[2:])
    assert (args.compile, args.block_size, args.batch_size, args.precision, args.nproc) == \
        (True, 2048, 4, "bf16", 1)
    if mode == "float8":
        assert args.float8 == "rowwise"


def transformers_parameters(directory: Path) -> int:
    """The parameters of DIR's model as transformers itself loads it (not brigade's loader)."""
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(directory).parameters())


def test_a_tiny_model_of_the_kind_trains_on_the_text_by_the_runs_command_line(tmp_path):
    """write_model and write_text make what `brigade train` reads, by the run's own line (uncompiled
    here, tiny and fp32 on the CPU: what changes on the GPU is only the size)."""
    model = gm.write_model(tmp_path / "model", TINY, device="cpu")
    data = gm.write_text(tmp_path / "text")
    docs = [json.loads(line)["text"] for line in data.read_text(encoding="utf-8").splitlines()]
    assert len(docs) > 2 and all(len(d) == gm.DOCUMENT_CHARS for d in docs[:-1])
    assert json.loads((model / "config.json").read_text())["dtype"] == "float32"  # brigade's masters: fp32
    # the count brigade builds, against the formula and the weights transformers wrote (tied: once)
    weights = transformers_parameters(model)
    assert gm.brigade_model(model) == (TINY, llama_parameters(TINY)) and weights == llama_parameters(TINY)
    argv = gc.brigade_argv("bf16", model, data, 4, 2, tmp_path / "run", seq_len=32)
    argv = [a for a in argv if a != "--compile"] + ["--precision", "fp32"]
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    figures = gc.brigade_figures(tmp_path / "run", warmup=2)
    assert figures["steps_timed"] == 2 and figures["tokens_per_s"] > 0


@pytest.fixture
def stand_ins(tiny_run, monkeypatch):
    """`compare`'s course on this CPU: a GPU that says what an H200 says, and each side's command
    replaced by one that leaves what the real one leaves (brigade's metrics.jsonl, a real run's;
    torchtitan's step lines); `stand_ins(titan=CODE)` makes torchtitan's side run CODE instead."""
    h200 = {"name": "NVIDIA H200", "capability": [9, 0], "memory_gib": 139.8, "torch": "2.13", "cuda": "13.0"}
    monkeypatch.setattr(gc, "gpu", lambda: dict(h200))
    monkeypatch.setattr(gc, "brigade_model", lambda _: (dict(gm.SHAPE), LLAMA_3_2_1B))

    def brigade_run(mode, model, data, steps, batch, out, seq_len=2048):
        return ["-c", f"import shutil; shutil.copytree({str(tiny_run)!r}, {str(out)!r})"]

    monkeypatch.setattr(gc, "brigade_argv", brigade_run)

    def use(titan_code=f"print({TITAN_LOG!r})", capability=(9, 0)):
        monkeypatch.setattr(titan, "argv", lambda mode, flags: ["-c", titan_code])
        h200["capability"] = list(capability)

    return use


def test_the_runs_make_the_json_both_sides_and_their_ratios(stand_ins, tmp_path, capsys):
    stand_ins()
    out = tmp_path / "json" / "compare.json"
    code = gc.main(["run", str(tmp_path), "--titan-python", sys.executable, "--steps", "6", "--warmup", "2",
                    "--json", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and set(result["runs"]) == {"bf16", "float8"}
    run = result["runs"]["float8"]
    assert run["brigade"]["steps_timed"] == 4 and run["torchtitan"]["steps_timed"] == 1
    assert run["ratio"]["tokens_per_s"] == pytest.approx(run["brigade"]["tokens_per_s"] / 20_000)
    assert run["brigade"]["peak_memory_gib"] is None  # no nvidia-smi here
    assert (tmp_path / "torchtitan-float8.log").read_text().count("step:") == 4
    assert result["model"]["params"] == LLAMA_3_2_1B and result["settings"]["float8"] == "rowwise"
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == f"wrote {out}"
    assert printed[-2].startswith("float8: brigade vs torchtitan: tokens/s/GPU")


def test_a_failed_side_is_its_exit_and_last_line_and_the_runs_exit_1(stand_ins, tmp_path):
    stand_ins("print('loading'); print('CUDA out of memory'); raise SystemExit(3)", capability=(8, 0))
    out = tmp_path / "compare.json"
    code = gc.main(["run", str(tmp_path), "--titan-python", sys.executable, "--steps", "6", "--warmup", "2",
                    "--json", str(out)])
    result = json.loads(out.read_text())
    assert code == 1 and result["runs"]["bf16"]["torchtitan"]["error"] == "exit 3: CUDA out of memory"
    assert result["runs"]["bf16"]["ratio"]["tokens_per_s"] is None
    assert result["runs"]["float8"] == {
        "skipped": "float8 matmuls need compute capability 8.9 or more; this GPU: 8.0"}


def test_without_nvidia_smi_memory_is_unknown(monkeypatch):
    monkeypatch.setattr(gc.shutil, "which", lambda _: None)
    with gc.DeviceMemory("0") as memory:
        pass
    assert memory.peak_gib is None


def test_sizes_that_time_nothing_are_refused():
    with pytest.raises(BrigadeError, match="1 <= warmup < steps - 1"):
        gc.main(["run", "OUT", "--titan-python", "python", "--steps", "11", "--warmup", "10"])
    with pytest.raises(BrigadeError, match="--batch 0"):
        gc.main(["check", "DIR", "--batch", "0"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this case is about a machine without a GPU")
def test_the_runs_without_a_gpu_are_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "brigade.results.gpu_compare", "run", str(tmp_path),
                           "--titan-python", sys.executable], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        "brigade.results.gpu_compare: error: no GPU is visible to torch")


# ---- the script itself, and what needs torchtitan (in the environment the script makes) ----

TITAN_ENV = Path(os.environ.get("BRIGADE_TITAN_ENV") or Path(os.environ.get("XDG_CACHE_HOME")
                 or Path.home() / ".cache") / "brigade" / f"torchtitan-{titan.VERSION}")


@pytest.fixture(scope="module")
def script_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """scripts/gpu-compare.sh as a user runs it on this machine (no GPU; the suite hides any)."""
    out = tmp_path_factory.mktemp("gpu-compare")
    json_before = (ROOT / gc.JSON).read_bytes() if (ROOT / gc.JSON).exists() else None
    done = subprocess.run([str(SCRIPT), str(out)], capture_output=True, text=True, timeout=1500,
                          env={**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""})
    json_after = (ROOT / gc.JSON).read_bytes() if (ROOT / gc.JSON).exists() else None
    assert json_after == json_before, f"{gc.JSON} changed on a machine without a GPU"
    return done, out


@pytest.mark.timeout(1600)
@pytest.mark.slow  # installs torchtitan into its own environment once (about a minute)
@pytest.mark.xdist_group("gpu_compare_script")
def test_the_script_checks_both_models_then_says_there_is_no_gpu_and_exits_0(script_run):
    done, out = script_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert (f"gpu-compare: parameters on the meta device: brigade {LLAMA_3_2_1B:,}, "
            f"torchtitan {titan.VERSION} {LLAMA_3_2_1B:,}: the same") in lines
    said = "\n".join(lines)
    assert "gpu-compare: torchtitan takes the run's command line: 40 steps of 4 x 2048 tokens" in said
    assert "swaps the 80 linear layers of the blocks (5 each) and keeps the head" in said
    assert lines[-1].startswith("gpu-compare: no GPU visible to torch: the check passed")
    assert gm.hf_shape(gm.hf_config()) == gm.SHAPE and (out / "model" / "config.json").is_file()


@pytest.mark.timeout(900)
@pytest.mark.slow  # installs torchtitan into its own environment once (about a minute)
@pytest.mark.xdist_group("gpu_compare_script")
def test_the_script_stops_in_one_line_when_the_check_fails(script_run, tmp_path):
    done = subprocess.run([str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=800,
                          env={**os.environ, "PYTHON": sys.executable, "GPU_COMPARE_WARMUP": "39"})
    assert done.returncode == 1 and done.stdout == "", done.stdout
    assert done.stderr.splitlines() == [
        "gpu-compare: the check failed: brigade.results.gpu_compare: error: --steps 40, --batch 4, "
        "--warmup 39: need a batch of 1 or more and 1 <= warmup < steps - 1, so that two steps or more "
        "are timed"]


def _in_titan_env(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """`code` run by the Python of the environment the script made (torchtitan 0.3.0 in it)."""
    return subprocess.run([str(TITAN_ENV / "bin" / "python"), "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)


FAILING_CHECK = """
import sys
from brigade.results import gpu_compare, gpu_compare_model, script, titan
{change}
script.run(lambda: gpu_compare.main(["check", sys.argv[1]]), "brigade.results.gpu_compare")
"""


@pytest.mark.timeout(900)
@pytest.mark.slow  # installs torchtitan into its own environment once (about a minute)
@pytest.mark.xdist_group("gpu_compare_script")
@pytest.mark.parametrize("change, said", [
    ("gpu_compare_model.SHAPE['ffn_dim'] = 8064",
     "the two models differ: ffn_dim 8064 (brigade) vs 8192 (torchtitan), wanted 8064"),
    ("count = titan.count_parameters; titan.count_parameters = lambda cfg: count(cfg) + 1",
     f"parameter counts differ on the meta device: brigade {LLAMA_3_2_1B:,}, "
     f"torchtitan {LLAMA_3_2_1B + 1:,}"),
    ("titan.VERSION = '0.2.0'", "torchtitan 0.3.0 is installed, the comparison runs torchtitan==0.2.0"),
])
def test_the_check_fails_in_one_line_when_the_sides_differ(script_run, tmp_path, change, said):
    done = _in_titan_env(FAILING_CHECK.format(change=change), tmp_path)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert last.startswith(f"brigade.results.gpu_compare: error: {said}"), last


@pytest.mark.timeout(900)
@pytest.mark.slow  # installs torchtitan into its own environment once (about a minute)
@pytest.mark.xdist_group("gpu_compare_script")
def test_the_stand_in_is_only_torchtitans_moe_kernels_and_fails_if_used(script_run, tmp_path):
    code = """
import importlib.util
from torch.utils._triton import has_triton
from brigade.results import titan
if importlib.util.find_spec("triton") is not None:
    raise SystemExit("triton is installed here: nothing is stood in for")
titan.llama3()
import torchtitan.distributed.minimal_async_ep as ep
try:
    ep.dispatch_op()
except RuntimeError as exc:
    print("refused:", exc)
print(titan.stood_in(), has_triton())
"""
    done = _in_titan_env(code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    refused = done.stdout.splitlines()[-2]
    assert refused.startswith("refused: torchtitan.distributed.minimal_async_ep was stood in"), refused
    assert done.stdout.splitlines()[-1] == "True False"  # torch's own probe still finds no triton
