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


def test_a_mixture_as_a_toml_table_is_the_flags_string(tmp_path):
    f = tmp_path / "mix.toml"
    f.write_text('[data]\ndata = {"web.txt" = 0.7, "code.txt" = 3}\n')
    assert config.load_toml(f) == {"data": {"data": "web.txt:0.7,code.txt:3"}}
    f.write_text('[data]\ndata = {"web.txt" = "lots"}\n')
    with pytest.raises(BrigadeError, match=r"^.*mix.toml: \[data\] data: corpus 'web.txt' has weight "
                                           r"'lots': a mixture's table maps each path to a number"):
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
    (["--pp", "2"], config.Launched(4, 4, "torchrun"), (4, 1, 2, 2)),  # the launcher's 4, not --nproc 2
    (["--pp", "2"], config.Launched(4, 2, "torchrun"), (2, 2, 2, 2)),  # two agents, 2 processes each
    (["--pp", "2"], config.Launched(4, None, "Slurm"), (4, 1, 2, 2)),
    (["--dp", "2", "--pp", "2", "--nproc", "4"], config.Launched(4, 4, "torchrun"), (4, 1, 2, 2)),
    (["--local-stages", "2"], config.Launched(2, 2, "torchrun"), (2, 1, 2, 1)),
])
def test_layout_is_derived_from_the_world(argv, world, expected):
    p = parse(*argv, world=world).parallel
    assert (p.nproc, p.nnodes, p.dp, p.pp) == expected


def test_resolve_layout_is_pure_and_idempotent():
    cfg = config.RunConfig()
    cfg.parallel.pp = 2
    world = config.Launched(4, 4, "torchrun")
    once = config.resolve_layout(cfg, world)
    assert cfg.parallel.dp == 0 and cfg.parallel.nproc == 2  # the input is untouched
    assert once.parallel.dp == 2 and config.resolve_layout(once, world) == once


@pytest.mark.parametrize("argv,world,message", [
    (["--nproc", "2", "--pp", "2"], config.Launched(4, 4, "torchrun"),
     r"^--nproc 2 but torchrun started 4 processes on this node: leave --nproc out under torchrun"),
    (["--nproc", "4", "--pp", "2"], config.Launched(4, None, "Slurm"), None),  # agrees: no error
    (["--dp", "1", "--pp", "2"], config.Launched(4, 4, "torchrun"),
     r"^--dp 1 × --pp 2 = 2 but the world size is 4 \(set by torchrun\): the world size must equal dp × pp,"
     r" or leave --dp out"),
    (["--pp", "3"], config.Launched(4, 4, "Slurm"),
     r"^world size 4 \(set by Slurm\) is not divisible by --pp 3: make it a multiple"),
    (["--nnodes", "1", "--pp", "2"], config.Launched(4, 2, "torchrun"),
     r"^--nnodes 1 but torchrun started 4 processes, 2 per node: leave --nnodes out under torchrun"),
    (["--pp", "2", "--batch-size", "6"], config.Launched(8, 8, "torchrun"),
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
        parse("--config", str(f), world=config.Launched(4, 4, "torchrun"))


# --- elastic ranges: --nnodes MIN:MAX (brigade/config/elastic.py) -----------------------------------------

ELASTIC = ["--rdzv-endpoint", "h:1", "--max-restarts", "1"]


@pytest.mark.parametrize("argv,message", [
    (["--nnodes", "2:1"], r"^--nnodes '2:1': expected MIN:MAX with 1 ≤ MIN ≤ MAX, like 1:2$"),
    (["--nnodes", "0:2"], r"^--nnodes '0:2': expected MIN:MAX with 1 ≤ MIN ≤ MAX"),
    (["--nnodes", "1-2"], r"^--nnodes '1-2': expected a number of machines like 2, or an elastic range"),
    (["--nnodes", "1:2:3"], r"^--nnodes '1:2:3': expected a number"),
    (["--nnodes", ":2"], r"^--nnodes ':2': expected a number"),
    # dp 3 at 3 nodes: 8 does not split over 3 replicas
    (["--nnodes", "1:3", "--nproc", "1", "--batch-size", "8", *ELASTIC],
     r"^--batch-size 8 cannot be kept on 3 node\(s\): .*; use a multiple of 12$"),
    # a chunk of 4 at 3 nodes, of 3 at 2 nodes (12 ÷ (dp 2 × 2 steps)): fewer than 4 micro-batches
    (["--nnodes", "2:3", "--nproc", "1", "--batch-size", "12", "--microbatches", "4", "--local-stages", "2",
      *ELASTIC], r"^--microbatches 4 is larger than each replica's batch \(3 on 2 node\(s\)\)"),
    (["--nnodes", "1:2", "--nproc", "1", "--rdzv-endpoint", "h:1"],
     r"^--nnodes 1:2 with --max-restarts 0: a lost node would end the run"),
    (["--nnodes", "1:2", "--nproc", "1", "--dp", "2", *ELASTIC],
     r"^--dp 2 with --nnodes 1:2: leave --dp out"),
    (["--nnodes", "1:3", "--nproc", "1", "--pp", "2", *ELASTIC],
     r"world size 3 .* is not divisible by --pp 2"),
])
def test_bad_elastic_ranges(argv, message):
    with pytest.raises(BrigadeError, match=message) as err:
        parse(*argv)
    assert err.value.exit_code == 2 and "\n" not in str(err.value)


def test_an_elastic_range_the_launcher_contradicts():
    with pytest.raises(BrigadeError, match=r"^--nnodes 1:2 but torchrun started 6 processes, 2 per node"):
        parse("--nnodes", "1:2", "--pp", "2", world=config.Launched(6, 2, "torchrun"))


@pytest.mark.parametrize("argv", [["--nnodes", "2:1"], ["--nnodes", "0:2"], ["--nnodes", "two"],
                                  ["--nnodes", "1:3", "--nproc", "1", "--batch-size", "8", *ELASTIC]])
def test_bad_elastic_ranges_on_the_command_line(argv, capsys, tmp_path):
    from brigade.cli import main

    assert main(["train", "--out", str(tmp_path / "run"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("brigade train: error: --") and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv,world,expected", [
    # (flags, launcher's world, (min_nodes, nnodes, dp, accumulation at each reachable dp))
    (["--nnodes", "1:2", "--nproc", "1", *ELASTIC], None, (1, 2, 2, {1: 2, 2: 1})),
    (["--nnodes", "1:2", "--nproc", "2", "--pp", "2", "--grad-accum", "2", *ELASTIC], None,
     (1, 2, 2, {1: 4, 2: 2})),
    (["--nnodes", "2:4", "--nproc", "1", "--batch-size", "24", *ELASTIC], None,
     (2, 4, 4, {2: 2, 3: 2, 4: 1})),
    (["--nnodes", "1:2", "--nproc", "1", "--pp", "2", *ELASTIC], None, (1, 2, 1, {1: 1})),  # waits for 2
    (["--nnodes", "2:2", "--rdzv-endpoint", "h:1"], None, (0, 2, 4, {4: 1})),  # MIN = MAX: not elastic
    (["--nnodes", "1:2", "--pp", "2"], config.Launched(2, 2, "torchrun"), (1, 2, 1, {1: 2, 2: 1})),
])
def test_elastic_layout_and_accumulation(argv, world, expected):
    from brigade.config.elastic import accumulation, first_nodes, reachable

    cfg = parse(*argv, world=world)
    p = cfg.parallel
    dps = [dp for _, dp in reachable(p)] if p.min_nodes else [p.dp]
    assert (p.min_nodes, p.nnodes, p.dp, {dp: accumulation(cfg, dp) for dp in dps}) == expected
    if p.min_nodes:
        assert first_nodes(p) == max(p.min_nodes, -(-p.pp // p.nproc))
        for dp in dps:  # the global batch is kept, and a replica's chunk never grows
            k, b = accumulation(cfg, dp), cfg.train.batch_size
            assert b % (dp * k) == 0 and b // (dp * k) <= b // (p.dp * accumulation(cfg, p.dp))


# --- one sentence per field: the help, the TOML file ------------------------------------------

def test_every_field_is_documented_and_its_flag_shows_the_sentence():
    import dataclasses

    from brigade.config.fielddoc import help_of

    p = argparse.ArgumentParser()
    config.add_flags(p)
    helps = {a.dest: a.help for a in p._actions}
    for cls in config.section_classes().values():
        for f in dataclasses.fields(cls):
            assert help_of(f), f"{cls.__name__}.{f.name} has no sentence: declare it with doc()"
            assert helps[f.name].startswith(help_of(f).replace("%", "%%")), f.name


def test_choices_come_from_their_registries():
    from brigade.models import BUILTIN
    from brigade.pipeline.plans import schedule

    p = argparse.ArgumentParser()
    config.add_flags(p)
    helps = {a.dest: a.help for a in p._actions}
    assert schedule.help_text() in helps["schedule"]
    assert all(name in helps["model"] for name in BUILTIN) and "file.py:factory" in helps["model"]
    assert "0: the schedule's own" in helps["virtual"] and "zbv and dualpipev 2" in helps["virtual"]


def test_to_toml_comments_every_key_and_loads_back_equal(tmp_path):
    from brigade.config.fielddoc import help_of

    cfg = parse("--schedule", "zb", "--no-tie-embeddings", "--data", 'a "quoted" file.txt',
                "--lr", "0.01", "--nnodes", "2", "--rdzv-endpoint", "h:29500", "--precision", "fp16")
    text = config.to_toml(cfg)
    lines = text.splitlines()
    for cls in config.section_classes().values():
        for f in __import__("dataclasses").fields(cls):
            at = next(i for i, line in enumerate(lines) if line.startswith(f"{f.name} = "))
            assert lines[at - 1] == "# " + help_of(f, long=False), f.name
    assert "# the pipeline schedule (brigade schedule draws one): gpipe, 1f1b" in text
    path = tmp_path / "run.toml"
    path.write_text(text)
    assert config.load_toml(path) == cfg.to_dict()
    again = parse("--config", str(path))
    assert again == cfg and again.model.tie_embeddings is False


def test_doc_refuses_an_undocumented_field():
    from brigade.config.fielddoc import doc

    with pytest.raises(ValueError, match="give the field a sentence"):
        doc(1, " ")


def test_adamw_auto_resolves_to_fused_where_the_device_has_the_kernel(monkeypatch):
    from brigade.config import optimizer

    assert optimizer.resolve("auto", "cpu") == "fused"  # torch ≥ 2.4 has it on the CPU
    assert optimizer.resolve("foreach", "cpu") == "foreach"
    assert optimizer.flags("fused") == {"fused": True, "foreach": False}
    assert optimizer.flags("for-loop") == {"fused": False, "foreach": False}
    monkeypatch.setattr(optimizer, "fused_devices", lambda: ("cuda",))
    assert optimizer.resolve("auto", "cpu") == "foreach"
    with pytest.raises(BrigadeError, match="--adamw fused: this torch has no fused AdamW for cpu devices"):
        optimizer.resolve("fused", "cpu")
    with pytest.raises(BrigadeError, match="--adamw 'adam': expected one of auto, fused, foreach, for-loop"):
        optimizer.resolve("adam", "cpu")


def test_a_run_names_the_update_it_resolved_to():
    from brigade.train.run import with_update

    cfg = with_update(parse("--backend", "gloo"))
    assert cfg.optim.adamw == "fused" and "adamw = \"fused\"" in config.to_toml(cfg)
    assert with_update(parse("--adamw", "for-loop")).optim.adamw == "for-loop"
