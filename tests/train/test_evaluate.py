"""`brigade eval` (brigade/train/evaluate.py): a run's newest snapshot scored on held-out text,
the same under every layout, and every mistake one line before any worker starts."""

import json
import math
import shutil

import pytest
import torch

from brigade.data.text import CharDataset
from brigade.errors import BrigadeError
from brigade.train.evaluate import windows
from tests.e2e.helpers import brigade


def test_the_windows_tile_the_text_in_whole_batches():
    text = CharDataset(torch.arange(100), 8)  # a window at every character, when trained on
    got = windows(text, 4, 0)
    assert [b.tolist() for b in got] == [[0, 8, 16, 24], [32, 40, 48, 56], [64, 72, 80, 88]]
    assert len(windows(text, 4, 2)) == 2
    with pytest.raises(BrigadeError, match="holds 12 windows, fewer than one batch of --batch-size 16"):
        windows(text, 16, 0)


@pytest.fixture
def run(tiny_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(tiny_run, out)
    return out


@pytest.mark.parametrize("args,message", [
    (["--from", "{tmp}/none"], "--from '{tmp}/none' has no config.toml: give the --out folder of a "
                               "training run"),
    (["--from", "{run}", "--batches", "-1"], "--batches -1: must be ≥ 0 (0: every whole batch)"),
    (["--from", "{run}", "--data", "{tmp}/odd.txt"], "--data '{tmp}/odd.txt' has 1 character(s) the training "
                                                      "text lacks ('Ω')"),
    (["--from", "{run}", "--batch-size", "100000"], "fewer than one batch of --batch-size 100000"),
    (["--from", "{empty}"], "--from '{empty}' has no snapshot to score: train it until it writes one"),
])
def test_a_mistake_is_one_line_before_any_worker_starts(cli, run, tmp_path, args, message):
    (tmp_path / "odd.txt").write_text("Ω" * 100)
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(run / "config.toml", empty)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    fill = {"tmp": tmp_path, "run": run, "empty": empty}
    result = cli("eval", *[a.format(**fill) for a in args])
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message.format(**fill) in lines[0], result.stderr
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing written


@pytest.mark.full
def test_a_run_scores_the_same_under_every_layout(run):
    """The 6-step run's snapshot, on its own validation set: one process, two replicas, a
    two-stage pipeline and tensor parallel 2 give one loss (fp32, 1e-5) on the same tokens."""
    got = {}
    for name, layout in (("one", ["--nproc", "1"]), ("dp2", ["--nproc", "2"]),
                         ("pp2", ["--nproc", "2", "--pp", "2"]), ("tp2", ["--nproc", "2", "--tp", "2"])):
        done = brigade("eval", "--from", run, "--batches", "4", "--json", *layout)
        assert done.returncode == 0, done.stderr[-2000:]
        got[name] = json.loads(done.stdout.strip().splitlines()[-1])
    one = got["one"]
    # tiny_run (tests/conftest.py) trains tests/e2e/helpers.py's TINY: batch 8, block 32
    assert one["step"] == 6 and one["batches"] == 4 and one["tokens"] == 4 * 8 * 32
    assert one["perplexity"] == pytest.approx(math.exp(one["loss"]))
    for name, r in got.items():
        assert r["loss"] == pytest.approx(one["loss"], abs=1e-5), name
        assert r["tokens"] == one["tokens"], name


@pytest.mark.full
def test_a_mixture_is_scored_corpus_by_corpus(run, tmp_path):
    """`--data a:1,b:3`: each corpus scored on its own windows, as `--data` alone scores it, and
    the mixture's loss their mean by weight."""
    from brigade.data.text import default_corpus

    text = default_corpus()
    (tmp_path / "a.txt").write_text(text[:20_000])
    (tmp_path / "b.txt").write_text(text[20_000:40_000])
    alone = {}
    for name in ("a.txt", "b.txt"):
        done = brigade("eval", "--from", run, "--data", tmp_path / name, "--batches", "2", "--json")
        assert done.returncode == 0, done.stderr[-2000:]
        alone[name] = json.loads(done.stdout.strip().splitlines()[-1])
    done = brigade("eval", "--from", run, "--data", f"{tmp_path / 'a.txt'}:1,{tmp_path / 'b.txt'}:3",
                   "--batches", "2", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    mix = json.loads(done.stdout.strip().splitlines()[-1])
    parts = {k.rsplit("/", 1)[-1]: v for k, v in mix["corpora"].items()}
    assert [parts[n]["weight"] for n in ("a.txt", "b.txt")] == [1, 3]
    for name, got in alone.items():
        assert parts[name]["loss"] == pytest.approx(got["loss"], abs=1e-6)
        assert parts[name]["tokens"] == got["tokens"]
    assert mix["loss"] == pytest.approx((alone["a.txt"]["loss"] + 3 * alone["b.txt"]["loss"]) / 4, abs=1e-6)
    assert mix["tokens"] == alone["a.txt"]["tokens"] + alone["b.txt"]["tokens"]
