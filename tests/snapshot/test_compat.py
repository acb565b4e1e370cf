"""Whether a snapshot resumes a run (brigade/snapshot/compat.py): the learning rate's decay keeps
the end the run started with unless the user moves it, and a snapshot written before a setting
existed resumes where that setting is at its default."""

import dataclasses

import pytest

from brigade.config import RunConfig, config_subset
from brigade.snapshot.compat import check_compatible, run_facts
from brigade.snapshot.format import Manifest, SnapshotError


def _manifest(cfg: RunConfig) -> Manifest:
    facts = run_facts(cfg, cursor=0, epoch=0, vocab=None)
    return Manifest(step=6, params_sha256="0" * 64, world_size=1, files={"a.distcp": "0" * 64}, **facts)


def _with(cfg: RunConfig, **changes) -> RunConfig:
    optim = {k: v for k, v in changes.items() if hasattr(cfg.optim, k)}
    train = {k: v for k, v in changes.items() if hasattr(cfg.train, k)}
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, **optim),
                               train=dataclasses.replace(cfg.train, **train))


def test_the_decay_end_is_kept_in_the_manifest():
    assert _manifest(_with(RunConfig(), max_steps=6)).lr_end == 6
    assert _manifest(_with(RunConfig(), max_steps=6, decay_steps=4)).lr_end == 4


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "linear"])
def test_another_max_steps_resumes_only_where_the_decay_end_is_said(schedule):
    saved = _manifest(_with(RunConfig(), max_steps=6, lr_schedule=schedule))
    with pytest.raises(SnapshotError, match=f"ends its {schedule} decay on step 6"):
        check_compatible(saved, _with(RunConfig(), max_steps=9, lr_schedule=schedule))
    for end in (6, 9):  # kept, or stretched to the new end: either as the user says
        check_compatible(saved, _with(RunConfig(), max_steps=9, lr_schedule=schedule, decay_steps=end))
    check_compatible(saved, _with(RunConfig(), max_steps=6, lr_schedule=schedule))  # the same length


def test_a_constant_rate_has_no_decay_to_move():
    saved = _manifest(_with(RunConfig(), max_steps=6, lr_schedule="constant"))
    check_compatible(saved, _with(RunConfig(), max_steps=9, lr_schedule="constant"))


def test_another_schedule_is_another_configuration():
    saved = _manifest(_with(RunConfig(), max_steps=6))
    with pytest.raises(SnapshotError, match=r"another configuration \(differs in optim.lr_schedule\)"):
        check_compatible(saved, _with(RunConfig(), max_steps=6, lr_schedule="wsd"))


def test_a_snapshot_from_before_the_schedules_resumes_at_their_defaults():
    cfg = _with(RunConfig(), max_steps=6)
    new = _manifest(cfg)
    config = {**new.config, "optim": {k: v for k, v in new.config["optim"].items()
                                      if k not in ("lr_schedule", "decay_fraction")}}
    # nor did it keep the decay's end
    old = dataclasses.replace(new, config=config, config_hash="written-before", lr_end=None)
    check_compatible(old, _with(cfg, max_steps=9))
    with pytest.raises(SnapshotError, match=r"differs in optim.lr_schedule"):
        check_compatible(old, _with(cfg, lr_schedule="linear"))
    assert "decay_steps" not in config_subset(cfg)["optim"]  # moving the end is not another run


def test_the_refusal_fine_tuning_md_quotes_is_the_one_brigade_prints():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "fine-tuning.md").read_text()
    [quoted] = [line for line in page.splitlines() if line.startswith("brigade train: error: --max-steps")]
    cfg = _with(RunConfig(), lr_schedule="wsd", max_steps=60)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out="runs/wsd"))
    with pytest.raises(SnapshotError) as refused:
        check_compatible(_manifest(cfg), _with(cfg, max_steps=80))
    assert quoted == f"brigade train: error: {refused.value}"


def _hf(document_mask: bool = True) -> RunConfig:
    cfg = RunConfig()
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, model="hf:some/dir"),
                               data=dataclasses.replace(cfg.data, document_mask=document_mask))


def test_document_masks_on_or_off_are_another_configuration_for_an_hf_model_only():
    """The windows (and so the cursor) are the same either way, but not what attends to what: a
    resume keeps the setting it trained with. A snapshot from before the setting existed trained
    across documents: it resumes with --no-document-mask. The GPT's characters have no documents:
    the setting is not part of its configuration, nor of its snapshots' hash."""
    with pytest.raises(SnapshotError, match=r"another configuration \(differs in data.document_mask\)"):
        check_compatible(_manifest(_hf(True)), _hf(False))
    check_compatible(_manifest(_hf(False)), _hf(False))
    new = _manifest(_hf(False))
    config = {**new.config, "data": {k: v for k, v in new.config["data"].items() if k != "document_mask"}}
    old = dataclasses.replace(new, config=config, config_hash="written-before")
    check_compatible(old, _hf(False))
    with pytest.raises(SnapshotError, match=r"differs in data.document_mask"):
        check_compatible(old, _hf(True))
    gpt = RunConfig()
    assert "document_mask" not in config_subset(gpt)["data"]
    check_compatible(_manifest(gpt), dataclasses.replace(gpt, data=dataclasses.replace(gpt.data,
                                                                                       document_mask=False)))
