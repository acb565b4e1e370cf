"""The snapshot format: its typed manifest, what `verify` refuses, and what a user then sees.

Pure tests build a snapshot folder by hand; the CLI tests damage a copy of a real one from a tiny
run (`tiny_run`, tests/conftest.py, trained once per session) and check `brigade inspect`, run in
this process (one line, non-zero exit, nothing touched), and a resumed run's fallback.
"""

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from brigade.errors import BrigadeError
from brigade.snapshot.format import MANIFEST, Manifest, SnapshotError, find_latest, latest_step, verify
from brigade.snapshot.rng import rng_state, set_rng_state
from brigade.train.sample import sample_from_run
from tests.e2e.helpers import inspect, train


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


DATA = {".metadata": b"meta", "__0_0.distcp": b"weights", "rng_0.json": b"{}"}
GOOD = {
    "step": 6, "cursor": 48, "epoch": 0, "layout": {"dp": 1, "pp": 2, "local_stages": 1},
    "config_hash": "95bed76e9a2f07c1", "config": {"model": {"model": "gpt", "n_layer": 2}},
    "model": "gpt", "vocab": "abc", "params_sha256": _sha(b"params"), "world_size": 2,
    "files": {name: _sha(data) for name, data in DATA.items()},
}


def make_snapshot(root: Path, manifest: object = None, name: str = "step_00000006") -> Path:
    snap = root / "snapshots" / name
    snap.mkdir(parents=True)
    for file, data in DATA.items():
        (snap / file).write_bytes(data)
    (snap / MANIFEST).write_text(json.dumps(GOOD if manifest is None else manifest))
    return snap


def test_a_good_manifest_reads_as_attributes(tmp_path):
    m = verify(make_snapshot(tmp_path))
    assert isinstance(m, Manifest)
    assert (m.step, m.cursor, m.layout["pp"], m.model, m.vocab, m.world_size) == (6, 48, 2, "gpt", "abc", 2)
    assert m.to_json() == GOOD and m.extra == {}


def test_unknown_keys_are_kept_not_refused(tmp_path):
    m = verify(make_snapshot(tmp_path, {**GOOD, "added_later": [1, 2]}))
    assert m.extra == {"added_later": [1, 2]} and m.to_json()["added_later"] == [1, 2]


def test_a_model_without_vocabulary_is_fine(tmp_path):
    assert verify(make_snapshot(tmp_path, {**GOOD, "model": "toy", "vocab": None})).vocab is None


def _without(key: str) -> dict:
    return {k: v for k, v in GOOD.items() if k != key}


# (case, manifest JSON value, what the one line says)
MALFORMED = [
    ("not-an-object", [], "is a JSON list, not an object"),
    ("a-string", "step 6", "is a JSON str, not an object"),
    ("missing-step", _without("step"), "has no 'step' key"),
    ("missing-files", _without("files"), "has no 'files' key"),
    ("missing-params", _without("params_sha256"), "has no 'params_sha256' key"),
    ("step-a-string", {**GOOD, "step": "6"}, "has 'step' = \"6\", expected an integer ≥ 0"),
    ("step-a-bool", {**GOOD, "step": True}, "has 'step' = true, expected an integer ≥ 0"),
    ("step-negative", {**GOOD, "step": -1}, "has 'step' = -1, expected an integer ≥ 0"),
    ("layout-a-list", {**GOOD, "layout": [1, 2]}, "has 'layout' = [1, 2], expected an object of integers"),
    ("world-zero", {**GOOD, "world_size": 0}, "has 'world_size' = 0, expected an integer ≥ 1"),
    ("hash-short", {**GOOD, "params_sha256": "abc"}, "expected a sha256 hex digest"),
    ("files-a-list", {**GOOD, "files": list(DATA)}, "has 'files' = [\".metadata\""),
    ("files-empty", {**GOOD, "files": {}}, "has 'files' = {}, expected a non-empty object"),
    ("file-outside", {**GOOD, "files": {**GOOD["files"], "../x": _sha(b"")}}, "has 'files' = "),
    ("scale-zero", {**GOOD, "loss_scale": {"scale": 0, "good_steps": 1}}, "has 'loss_scale' = "),
    ("scale-no-steps", {**GOOD, "loss_scale": {"scale": 2.0}}, "expected null or an object of scale > 0"),
    ("balance-zero", {**GOOD, "balance": [3, 0]}, "expected null or a non-empty list of integers ≥ 1"),
    ("balance-text", {**GOOD, "balance": "3,3"}, "has 'balance' = \"3,3\""),
]


@pytest.mark.parametrize("case,manifest,message", MALFORMED, ids=[c[0] for c in MALFORMED])
def test_a_malformed_manifest_is_a_damaged_snapshot(tmp_path, case, manifest, message):
    snap = make_snapshot(tmp_path, manifest)
    with pytest.raises(SnapshotError) as err:
        verify(snap)
    text = str(err.value)
    assert message in text and text.endswith(": the snapshot is damaged") and "\n" not in text


def test_a_manifest_that_is_not_json(tmp_path):
    snap = make_snapshot(tmp_path)
    (snap / MANIFEST).write_bytes(b"\xff{")
    with pytest.raises(SnapshotError, match="is not JSON: the snapshot is damaged"):
        verify(snap)


def test_a_listed_file_missing(tmp_path):
    snap = make_snapshot(tmp_path)
    (snap / "__0_0.distcp").unlink()
    with pytest.raises(SnapshotError, match="__0_0.distcp is missing"):
        verify(snap)


def test_a_file_the_manifest_does_not_list(tmp_path):
    snap = make_snapshot(tmp_path)
    (snap / "__1_0.distcp").write_bytes(b"more weights")
    with pytest.raises(SnapshotError, match=r"__1_0.distcp is not in its manifest.json"):
        verify(snap)


def test_a_checksum_mismatch(tmp_path):
    snap = make_snapshot(tmp_path)
    (snap / "rng_0.json").write_bytes(b"[]")
    with pytest.raises(SnapshotError, match="rng_0.json does not match its checksum"):
        verify(snap)


def test_fp16_loss_scale_is_an_optional_typed_key(tmp_path):
    scaled = {**GOOD, "loss_scale": {"scale": 131072.0, "good_steps": 1}}
    m = verify(make_snapshot(tmp_path, scaled))
    assert m.loss_scale == {"scale": 131072.0, "good_steps": 1} and m.to_json() == scaled
    assert verify(make_snapshot(tmp_path, name="step_00000003")).loss_scale is None  # older snapshots


def test_the_cut_is_an_optional_typed_key(tmp_path):
    cut = {**GOOD, "balance": [1, 1, 1, 3]}
    m = verify(make_snapshot(tmp_path, cut))
    assert m.balance == [1, 1, 1, 3] and m.to_json() == cut
    assert verify(make_snapshot(tmp_path, name="step_00000003")).balance is None  # older snapshots


def test_latest_step_reads_the_pointer_only(tmp_path):
    assert latest_step(tmp_path) is None
    make_snapshot(tmp_path)
    assert latest_step(tmp_path) is None  # no LATEST yet
    (tmp_path / "snapshots" / "LATEST").write_text("step_00000006\n")
    assert latest_step(tmp_path) == 6
    (tmp_path / "snapshots" / "LATEST").write_text("garbage")
    assert latest_step(tmp_path) is None


def test_find_latest_falls_back_past_a_malformed_manifest(tmp_path):
    make_snapshot(tmp_path, name="step_00000003")
    make_snapshot(tmp_path, {**GOOD, "files": {}})
    warnings = []
    found = find_latest(tmp_path, warn=warnings.append)
    assert found.path.name == "step_00000003" and found.manifest.step == 6
    assert len(warnings) == 1 and warnings[0].startswith("skipping snapshot step_00000006: ")


def test_generate_refuses_a_model_config_it_cannot_build(tmp_path):
    snap = make_snapshot(tmp_path, {**GOOD, "config": {"model": {"model": "gpt", "n_layers": 2}}})
    with pytest.raises(BrigadeError, match="config.model is not a brigade model config"):
        sample_from_run(snap, "a", 3)


def test_rng_state_without_gpus_round_trips():
    state = rng_state([torch.device("cpu")])
    assert "cuda" not in state  # only the process's own GPUs are saved, and here there are none
    want = (torch.rand(3), random.random())
    torch.manual_seed(123)
    random.seed(123)
    set_rng_state(json.loads(json.dumps(state)), [torch.device("cpu")])
    assert torch.equal(torch.rand(3), want[0]) and random.random() == want[1]


# --- as a user sees it: `brigade inspect` and a resumed run ------------------------------------

@pytest.fixture
def run(tiny_run):
    return tiny_run


def _damage(snap: Path, case: str) -> str:
    """Damage `snap` as `case` says; returns the text `inspect`'s one line must contain."""
    manifest = json.loads((snap / MANIFEST).read_text())
    if case == "not-an-object":
        manifest = []
    elif case == "missing-key":
        del manifest["params_sha256"]
    elif case == "wrongly-typed-key":
        manifest["step"] = "six"
    elif case == "empty-file-list":
        manifest["files"] = {}
    elif case == "listed-file-missing":
        (snap / "rng_1.json").unlink()
        return f"{snap}: rng_1.json is missing"
    elif case == "unlisted-file":
        (snap / "__9_0.distcp").write_bytes(b"stray")
        return f"{snap}: __9_0.distcp is not in its manifest.json"
    (snap / MANIFEST).write_text(json.dumps(manifest))
    return {"not-an-object": "is a JSON list, not an object", "missing-key": "has no 'params_sha256' key",
            "wrongly-typed-key": "has 'step' = \"six\", expected an integer ≥ 0",
            "empty-file-list": "has 'files' = {}, expected a non-empty object of file name → sha256 "
            "hex digest"}[case] \
        + ": the snapshot is damaged"


CASES = ["not-an-object", "missing-key", "wrongly-typed-key", "empty-file-list", "listed-file-missing",
         "unlisted-file"]


def _files(root: Path) -> dict:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", CASES)
def test_inspect_a_damaged_snapshot(run, cli, tmp_path, case):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    snap = out / "snapshots" / "step_00000006"
    message = _damage(snap, case)
    before = _files(out)
    result = cli("inspect", snap)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stdout + result.stderr and result.stdout == ""
    # the run folder falls back to the previous good snapshot, with a warning
    result = cli("inspect", out, "--json")
    assert result.returncode == 0 and json.loads(result.stdout)["step"] == 3, result.stderr
    assert "skipping snapshot step_00000006" in result.stderr
    assert _files(out) == before, "inspect must not touch a snapshot"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["listed-file-missing", "not-an-object"])
def test_every_command_that_loads_a_snapshot_names_its_step_and_warns_of_one_skipped(run, cli, tmp_path,
                                                                                     case):
    """generate fell back to an older snapshot without a word: now it says which step it sampled
    from, after one warning per damaged snapshot it skipped (as inspect and train do)."""
    out = tmp_path / "run"
    shutil.copytree(run, out)
    _damage(out / "snapshots" / "step_00000006", case)
    gen = cli("generate", "--from", out, "--tokens", "5")
    assert gen.returncode == 0, gen.stderr
    lines = gen.stderr.splitlines()
    assert lines[0].startswith("brigade: warning: skipping snapshot step_00000006: "), gen.stderr
    assert lines[1] == f"brigade generate: sampling from snapshot step 3 ({out}/snapshots/step_00000003)"
    assert len(lines) == 2 and gen.stdout.strip()
    result = cli("inspect", out)
    assert "brigade: warning: skipping snapshot step_00000006" in result.stderr
    assert "step: 3" in result.stdout
    gen = cli("generate", "--from", out / "snapshots" / "step_00000003", "--tokens", "5")
    assert gen.stderr.splitlines() == [f"brigade generate: sampling from snapshot step 3 "
                                       f"({out}/snapshots/step_00000003)"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["not-an-object", "unlisted-file"])
def test_a_run_resumes_from_the_snapshot_before_a_damaged_one(run, tmp_path, case):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    _damage(out / "snapshots" / "step_00000006", case)
    # on to step 9, the decay kept where the 6-step run ended it (docs/fine-tuning.md)
    result = train(out, "--max-steps", "9", "--decay-steps", "6", "--snapshot-every", "3", "--sample-tokens", "0")
    assert result.returncode == 0, result.stderr
    assert "warning: skipping snapshot step_00000006" in result.stdout + result.stderr
    assert "resuming from snapshot step 3" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr
    assert inspect(out)["step"] == 9
