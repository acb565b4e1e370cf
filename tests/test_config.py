import argparse

import pytest

from brigade import config
from brigade.errors import BrigadeError


def parse(*argv, toml=None, world=None):
    p = argparse.ArgumentParser()
    config.add_flags(p)
    return config.build(p.parse_args(list(argv)), toml, world=world)


def test_defaults_are_two_processes_data_parallel():
    cfg = parse()
    assert (cfg.parallel.nproc, cfg.parallel.dp, cfg.parallel.pp) == (2, 2, 1)
    assert cfg.model.model == "gpt" and cfg.data.data == ""


def test_flags_come_from_fields():
    cfg = parse("--pp", "2", "--microbatches", "8", "--max-steps", "7", "--dropout", "0.1",
                "--no-bf16", "--data", "x.txt", "--model", "gpt", "--seed", "3", "--batch-size", "16")
    assert (cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.microbatches) == (2, 1, 8)
    assert (cfg.train.max_steps, cfg.model.dropout, cfg.train.bf16) == (7, 0.1, False)
    assert (cfg.data.data, cfg.train.seed, cfg.train.batch_size) == ("x.txt", 3, 16)


def test_toml_then_flags_override(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("[parallel]\nnproc = 4\npp = 2\n[optim]\nlr = 1\n[train]\nmax_steps = 9\n")
    cfg = parse("--config", str(f), "--max-steps", "5")
    assert (cfg.parallel.nproc, cfg.parallel.pp, cfg.parallel.dp) == (4, 2, 2)
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.train.max_steps == 5


@pytest.mark.parametrize("text,message", [
    ("[train]\nmax_stepz = 3\n", "unknown key 'max_stepz' in \\[train\\]"),
    ("[trian]\nmax_steps = 3\n", "unknown section \\[trian\\]"),
    ("[train]\nmax_steps = 'ten'\n", "max_steps = 'ten' is a str, expected int"),
    ("[train\nmax_steps = 3\n", "is not valid TOML"),
])
def test_bad_toml(tmp_path, text, message):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(BrigadeError, match=message):
        config.load_toml(f)


def test_missing_toml(tmp_path):
    with pytest.raises(BrigadeError, match="config file .* not found"):
        config.load_toml(tmp_path / "nope.toml")


@pytest.mark.parametrize("argv,message", [
    (["--nproc", "3", "--pp", "2"], r"world size 3 \(--nproc 3 × --nnodes 1\) is not divisible by --pp 2"),
    (["--nproc", "4", "--dp", "3", "--pp", "2"], "the world size must equal dp × pp"),
    (["--block-size", "256"], "larger than the model's context 128"),
    (["--batch-size", "0"], "--batch-size 0: must be ≥ 1"),
    (["--max-steps", "-1"], "--max-steps -1: must be ≥ 1"),
    (["--lr", "-0.1"], "--lr -0.1: must be ≥ 0"),
    (["--dropout", "1.5"], "--dropout 1.5"),
    (["--pp", "2", "--microbatches", "64"], "--microbatches 64 is larger than each replica's batch"),
    (["--schedule", "zigzag"], "--schedule 'zigzag'"),
    (["--batch-size", "33"], "does not split evenly over dp 2"),
    (["--n-embd", "100", "--n-head", "3"], "not a multiple of --n-head 3"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank 2: must be between 0"),
    (["--nnodes", "2", "--rdzv-endpoint", "h"], "expected HOST:PORT of node 0"),
])
def test_validation_errors(argv, message):
    with pytest.raises(BrigadeError, match=message):
        parse(*argv)


# --- the layout: derived from the world in one place (config.resolve_layout) ---------------------

def test_build_does_not_change_what_validate_sees():
    cfg = config.RunConfig()
    config.validate(cfg)
    assert cfg.parallel.dp == 0  # validate checks, it does not derive


@pytest.mark.parametrize("argv,world,expected", [
    # (flags, launcher's world or None, (nproc, nnodes, dp, pp) after resolution)
    ([], None, (2, 1, 2, 1)),
    (["--nproc", "4", "--pp", "2"], None, (4, 1, 2, 2)),
    (["--nproc", "2", "--nnodes", "2", "--pp", "2", "--rdzv-endpoint", "h:1"], None, (2, 2, 2, 2)),
    (["--nproc", "2", "--local-stages", "2"], None, (2, 1, 2, 1)),  # local stages live in a process
    (["--pp", "2"], config.World(4, 4, "torchrun"), (4, 1, 2, 2)),  # the launcher's 4, not --nproc 2
    (["--pp", "2"], config.World(4, 2, "torchrun"), (2, 2, 2, 2)),  # two agents, 2 processes each
    (["--pp", "2"], config.World(4, None, "Slurm"), (4, 1, 2, 2)),
    (["--dp", "2", "--pp", "2", "--nproc", "4"], config.World(4, 4, "torchrun"), (4, 1, 2, 2)),
    (["--local-stages", "2"], config.World(2, 2, "torchrun"), (2, 1, 2, 1)),
])
def test_layout_is_derived_from_the_world(argv, world, expected):
    p = parse(*argv, world=world).parallel
    assert (p.nproc, p.nnodes, p.dp, p.pp) == expected


def test_resolve_layout_is_pure_and_idempotent():
    cfg = config.RunConfig()
    cfg.parallel.pp = 2
    world = config.World(4, 4, "torchrun")
    once = config.resolve_layout(cfg, world)
    assert cfg.parallel.dp == 0 and cfg.parallel.nproc == 2  # the input is untouched
    assert once.parallel.dp == 2 and config.resolve_layout(once, world) == once


@pytest.mark.parametrize("argv,world,message", [
    (["--nproc", "2", "--pp", "2"], config.World(4, 4, "torchrun"),
     r"^--nproc 2 but torchrun started 4 processes on this node: leave --nproc out under torchrun"),
    (["--nproc", "4", "--pp", "2"], config.World(4, None, "Slurm"), None),  # agrees: no error
    (["--dp", "1", "--pp", "2"], config.World(4, 4, "torchrun"),
     r"^--dp 1 × --pp 2 = 2 but the world size is 4 \(set by torchrun\): the world size must equal dp × pp,"
     r" or leave --dp out"),
    (["--pp", "3"], config.World(4, 4, "Slurm"),
     r"^world size 4 \(set by Slurm\) is not divisible by --pp 3: make it a multiple"),
    (["--nnodes", "1", "--pp", "2"], config.World(4, 2, "torchrun"),
     r"^--nnodes 1 but torchrun started 4 processes, 2 per node: leave --nnodes out under torchrun"),
    (["--pp", "2", "--batch-size", "6"], config.World(8, 8, "torchrun"),
     r"^--batch-size 6 does not split evenly over dp 4"),
])
def test_flags_that_contradict_the_launcher(argv, world, message):
    if message is None:
        assert parse(*argv, world=world).parallel.dp == 2
        return
    with pytest.raises(BrigadeError, match=message) as err:
        parse(*argv, world=world)
    assert "\n" not in str(err.value)


def test_a_config_file_counts_as_given(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("[parallel]\nnproc = 2\npp = 2\n")
    with pytest.raises(BrigadeError, match="--nproc 2 but torchrun started 4"):
        parse("--config", str(f), world=config.World(4, 4, "torchrun"))
