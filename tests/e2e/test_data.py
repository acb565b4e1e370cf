"""Data at scale, through the CLI: `brigade tokenize` once, then runs that memory-map the shards;
a run resumed on another layout reads the same samples at the same steps as the one it left."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.e2e.helpers import brigade
from tests.models.hf.dirs import hf, tiny_dir

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(400), pytest.mark.xdist_group("hf-e2e")]
RUN = ["--block-size", "32", "--batch-size", "8", "--max-steps", "20", "--snapshot-every", "10",
       "--eval-every", "100", "--sample-tokens", "0", "--lr", "3e-3", "--warmup-steps", "2",
       "--seed", "3", "--dropout", "0"]


def _steps(out) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from brigade.data.text import default_corpus

    folder = tmp_path_factory.mktemp("corpus")
    (folder / "a.txt").write_text(default_corpus()[:30_000])
    (folder / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                            for t in default_corpus()[30_000:60_000].split("\n\n")))
    done = brigade("tokenize", folder, "--model", hf("llama"), "--out", folder / "shards")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tokens" in done.stdout and "--data" in done.stdout
    return folder / "shards"


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--nproc", "1"], ["--nproc", "2", "--pp", "2"]], ids=["dp1", "pp2"])
def test_a_run_resumed_on_another_layout_reads_the_same_samples(tmp_path, shards, layout):
    whole = tmp_path / "dp2"
    done = brigade("train", "--out", whole, "--model", hf("llama"), "--data", shards, "--nproc", "2",
                   *RUN)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = tmp_path / "resumed"
    (resumed / "snapshots").mkdir(parents=True)
    shutil.copytree(whole / "snapshots" / "step_00000010", resumed / "snapshots" / "step_00000010")
    done = brigade("train", "--out", resumed, "--model", hf("llama"), "--data", shards, *layout, *RUN)
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = _steps(whole), _steps(resumed)
    assert sorted(after) == list(range(11, 21))
    for step in after:
        assert after[step]["samples"] == before[step]["samples"], step
        assert abs(after[step]["loss"] - before[step]["loss"]) < 1e-5, (step, after[step], before[step])
    assert len({before[s]["samples"] for s in before}) == 20  # every step a batch of its own


def test_unprepared_data_is_tokenized_once_into_the_run(tmp_path):
    from brigade.data.text import default_corpus

    text = tmp_path / "notes.txt"
    text.write_text(default_corpus()[:20_000])
    run = tmp_path / "run"
    args = ["train", "--out", run, "--model", hf("llama"), "--data", text, "--nproc", "1",
            *RUN[:2], "--eval-every", "100", "--sample-tokens", "0",
            "--decay-steps", "6"]  # one schedule for the three runs, 2, 4 then 6 steps long
    assert brigade(*args, "--max-steps", "2").returncode == 0
    manifest = json.loads((run / "tokens" / "manifest.json").read_text())
    assert manifest["sources"][0]["path"] == str(text.resolve())
    assert manifest["tokenizer"] == tiny_dir("llama")
    stamp = (run / "tokens" / "tokens-00000.bin").stat().st_mtime_ns
    assert brigade(*args, "--max-steps", "4").returncode == 0  # resumes at step 2
    assert (run / "tokens" / "tokens-00000.bin").stat().st_mtime_ns == stamp  # not tokenized again
    snapshot = json.loads((run / "snapshots" / "step_00000004" / "manifest.json").read_text())
    text.write_text(default_corpus()[20_000:40_000])  # the data changes under the run
    done = brigade(*args, "--max-steps", "6")
    assert done.returncode == 0 and "the data changed since snapshot step 4 (token shards " \
        f"{snapshot['data'][:12]} then" in done.stdout, done.stdout[-2000:]
