"""`brigade generate` refuses, in one line, what it cannot sample from: a run of a model that is
neither a GPT trained on text nor an hf:DIR model, and fewer than one token."""

from __future__ import annotations

import dataclasses

import pytest

from brigade.errors import BrigadeError
from brigade.snapshot.format import Snapshot, resolve
from brigade.train.sample import sample_from_snapshot


@pytest.mark.parametrize("model,tokens,message", [
    ("toy", 5, "is a toy run: generate needs a GPT trained on text or an hf:DIR model"),
    ("gpt", 0, "--tokens 0: must be ≥ 1"),
    ("hf:/nowhere", 0, "--tokens 0: must be ≥ 1"),
])
def test_generate_refuses_what_it_cannot_sample(tiny_run, model, tokens, message):
    found = resolve(tiny_run)
    other = Snapshot(found.path, dataclasses.replace(found.manifest, model=model))
    with pytest.raises(BrigadeError, match=message):
        sample_from_snapshot(other, "a", tokens)


def test_generate_and_export_of_a_run_whose_directory_is_gone(tiny_run):
    from brigade.train.export import trained_blocks

    found = resolve(tiny_run)
    gone = Snapshot(found.path, dataclasses.replace(found.manifest, model="hf:/nowhere/model"))
    for read in (lambda: trained_blocks(gone), lambda: sample_from_snapshot(gone, "a", 3)):
        with pytest.raises(BrigadeError, match="was trained from /nowhere/model, which is gone"):
            read()
