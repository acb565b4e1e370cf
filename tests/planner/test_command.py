"""`brigade plan` as a user runs it: the table, --json, --write-config that brigade train accepts
and whose measured peak the plan predicted; and each bad input one line, nothing written."""

import json

import pytest

from brigade.planner.memory import rank_memory
from brigade.train.metrics import events, read_records
from tests.e2e.helpers import brigade

pytestmark = pytest.mark.timeout(240)
PLAN = [
    "plan",
    "--model",
    "gpt",
    "--n-layer",
    "2",
    "--n-embd",
    "32",
    "--n-head",
    "2",
    "--seq-len",
    "32",
    "--batch-size",
    "8",
    "--gpus-per-node",
    "2",
    "--device",
    "cpu",
]
QUIET = [
    "--eval-every",
    "1000",
    "--eval-batches",
    "1",
    "--sample-tokens",
    "0",
    "--warmup-steps",
    "2",
    "--snapshot-every",
    "0",
]


def test_json_then_write_config_that_train_runs_within_the_predicted_memory(cli, tmp_path):
    toml = tmp_path / "plan.toml"
    done = cli(
        *PLAN,
        "--dp",
        "2",
        "--shard",
        "1",
        "--microbatches",
        "1",
        "--recompute",
        "none",
        "--json",
        "--write-config",
        str(toml),
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    row = result["rows"][0]
    assert row["label"] == "dp 2, m 1" and row["source"] == "measured" and row["fits"]
    assert {"step_s", "tokens_per_s", "mfu", "bubble", "comm_share", "memory", "over_bytes"} <= set(row)
    assert set(row["memory"]) == {"params", "grads", "optimizer", "activations", "split", "optimizer_step",
                                  "peak", "reserved"}
    assert row["memory"]["reserved"] == row["memory"]["peak"]  # a CPU's malloc: nothing reserved beyond
    assert "dp = 2" in toml.read_text() and "batch_size = 8" in toml.read_text()
    run = tmp_path / "run"
    trained = brigade("train", "--config", toml, "--out", run, *QUIET, "--max-steps", "3")
    assert trained.returncode == 0, trained.stderr
    (mem,) = events(read_records(run), "memory")
    for rank in (0, 1):
        measured, predicted = mem[f"rank{rank}/peak"], row["memory"]["peak"]
        # docs/plan.md's target, memory within 10 % on every layout (here -2.5 % on both ranks)
        assert abs(predicted - measured) / measured < 0.10, (predicted, measured)
        assert mem[f"rank{rank}/params"] == pytest.approx(row["memory"]["params"], rel=0.01)


def test_the_table_names_its_columns_and_sources(cli):
    done = cli(*PLAN, "--pp", "2", "--schedules", "1f1b,zb", "--microbatches", "2", "--top", "3")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "layouts, costs measured" in lines[0]
    assert lines[1].split()[:3] == ["layout", "step", "ms"] and len(lines) == 2 + 3
    assert all(line.rstrip().endswith("measured") for line in lines[2:])


def test_memory_of_a_pipeline_rank_counts_its_stages_and_what_they_hold():
    from brigade.planner.costs import ModeCosts, ModelCosts
    from brigade.planner.devices import TABLE
    from brigade.planner.space import Layout

    mode = ModeCosts(
        {1: [(1.0,) * 4] * 4}, held=[10.0] * 4, working=[0.0, 5.0, 0.0, 0.0], transient=[1.0] * 4,
        kept=[0.0] * 4,
    )
    costs = ModelCosts(
        "m",
        [{1: 100}, {2: 100}, {3: 100}, {1: 100}],
        [1.0] * 4,
        [1.0] * 4,
        {"none": mode},
        0.0,
        TABLE["h100"],
    )
    lay = Layout(1, 1, 2, "1f1b", 1, 4, "none")
    first = rank_memory(costs, lay, [2, 2], {0: 2, 1: 1}, mb=3, pp_rank=0)
    assert first["params"] == 200 and first["optimizer"] == 400
    assert first["activations"] == 2 * 10 * 3 * 2 + 5 * 3  # 2 blocks × 10 B × 3 samples × 2 held, + working
    last = rank_memory(costs, lay, [2, 2], {0: 2, 1: 1}, mb=3, pp_rank=1)
    assert last["params"] == 200  # block 3's weight is block 0's, but on another rank: its own copy
    shard = rank_memory(costs, Layout(1, 2, 2, "1f1b", 1, 4, "none"), [2, 2], {0: 2, 1: 1}, mb=3, pp_rank=0)
    assert shard["params"] == 100


BAD = [
    ("missing field", ["--cluster", "{tmp}/c.toml"], "no device.mem_bw for device 'mygpu'"),
    ("pp does not divide", ["--gpus-per-node", "4", "--device", "h100", "--pp", "3"],
     "--pp 3 does not divide the cluster's 4 ranks"),
    ("more stages than blocks", ["--gpus-per-node", "8", "--device", "h100", "--pp", "8"],
     "--pp 8: the model has 4 blocks"),
    ("unknown device", ["--device", "tpu"], "--device 'tpu': unknown device"),
    ("no known peak", ["--cluster", "{tmp}/nobf16.toml", "--precision", "bf16"],
     "device 'h100' has no known bf16 peak"),
]


@pytest.mark.parametrize("case, args, words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_exit_2_nothing_written(cli, tmp_path, case, args, words):
    (tmp_path / "c.toml").write_text("nodes = 1\ndevices_per_node = 2\n[device]\nname = 'mygpu'\n"
                                     "peak_fp32 = 1e12\npeak_bf16 = 0\nmemory = 1e9\nintra_bw = 1e9\n"
                                     "intra_latency = 0\ninter_bw = 1e9\ninter_latency = 0\n")
    (tmp_path / "nobf16.toml").write_text("nodes = 1\ndevices_per_node = 2\n[device]\nname = 'h100'\n"
                                          "peak_bf16 = 0\n")
    out = tmp_path / "out.toml"
    argv = [*PLAN[:-4], *(a.format(tmp=tmp_path) for a in args), "--write-config", str(out)]
    done = cli(*argv)
    assert done.returncode == 2 and not out.exists()
    assert len(done.stderr.strip().splitlines()) == 1 and words in done.stderr, done.stderr


@pytest.mark.parametrize("costs", ["measured", "formula"])
def test_a_model_whose_batch_is_a_structure_plans(cli, costs):
    """examples/llama.py: inputs {"tokens", "padding_mask"}, the mask a side input of every decoder."""
    done = cli("plan", "--model", "examples/llama.py:model", "--nodes", "1", "--gpus-per-node", "4",
               "--device", "h100", "--top", "2", *(["--costs", "formula"] if costs == "formula" else []))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 4 and lines[2].rstrip().endswith("formula" if costs == "formula" else "scaled")


@pytest.fixture
def config_only(tmp_path) -> str:
    """A Hugging Face directory with config.json alone (a tiny Llama's): no weights, no tokenizer."""
    import shutil

    from tests.models.hf.dirs import tiny_dir

    out = tmp_path / "config-only"
    out.mkdir()
    shutil.copy(f"{tiny_dir('llama')}/config.json", out / "config.json")
    return f"hf:{out}"


def test_a_directory_with_config_json_alone_plans_from_its_shapes(cli, config_only):
    done = cli("plan", "--model", config_only, "--nodes", "1", "--gpus-per-node", "8", "--device", "h100",
               "--batch-size", "16", "--seq-len", "64", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["source"] == "formula"  # auto: no weights to measure with
    row = result["rows"][0]
    assert row["tokens_per_s"] == pytest.approx(16 * 64 / row["step_s"])  # tokens, not samples
    config = result["model_config"]  # the directory's own, not the built-in GPT's
    assert config["model"] == config_only and config["hidden_size"] == 32 and "n_layer" not in config


def test_measured_costs_of_a_directory_without_weights_is_one_line(cli, config_only):
    done = cli("plan", "--model", config_only, "--gpus-per-node", "2", "--device", "h100",
               "--costs", "measured")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "has config.json but no weights to measure with: plan it with --costs formula" in done.stderr


def test_tokens_per_sample_is_a_language_models_sequence_and_one_otherwise():
    from brigade.models import load_model
    from brigade.pipeline.batches.sample import tokens_per_sample

    assert tokens_per_sample(load_model("examples/llama.py:model")) == 32  # its batch()'s block_size
    assert tokens_per_sample(load_model("toy")) == 1


def test_compile_from_shapes_fuses_the_memory_bound_ops_and_float8_runs_the_linears_faster(cli, config_only):
    def pipeline_s(*flags):
        done = cli("plan", "--model", config_only, "--gpus-per-node", "1", "--device", "h100",
                   "--batch-size", "4", "--seq-len", "64", "--recompute", "none", "--microbatches", "1",
                   "--json", *flags)
        assert done.returncode == 0, done.stderr
        (row,) = json.loads(done.stdout)["rows"]
        return row["pipeline_s"]

    eager, compiled = pipeline_s(), pipeline_s("--compile")
    assert compiled < eager < 1.6 * compiled  # only the memory-bound ops' bytes go: no stated factor
    assert pipeline_s("--compile", "--float8") < compiled
