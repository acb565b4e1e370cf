"""Writing snapshots in the background: what the call returns, what lands, what never does.

One launch of 2 gloo processes (each holding its own block, as pipeline stages do) walks a
writer through its cases, its writes held at a gate (the `during_write` hook) so that "while
it is being written" is a state the test holds, not a race it hopes to win:

- a synchronous snapshot's params_sha256, read back from its files, is the live model's;
- a background snapshot returns while its write is held; the model changes after the call,
  yet the snapshot holds the state at the call; a second save while one is in flight is
  refused; --keep 1 keeps the complete one until the new one is complete;
- abandoned before its commit (rank 0), a snapshot is never marked complete, and LATEST stays;
- a write that fails on one rank fails on every rank, in one line, and leaves no folder.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from brigade.launcher import agent, groups
from brigade.snapshot import collective
from brigade.snapshot.format import find_latest, read_manifest, read_pointer
from brigade.snapshot.writer import Writer

pytestmark = pytest.mark.timeout(240)
META = {"cursor": 0, "epoch": 0, "layout": {"dp": 1, "pp": 2}, "config_hash": "h", "config": {},
        "model": "m", "vocab": None}


def _model(rank: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed + rank)
    model = nn.ModuleDict({f"b{rank}": nn.Linear(8, 8)})
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model[f"b{rank}"](torch.ones(2, 8)).sum().backward()
    opt.step()
    return model, opt


class _Gate:
    """The during_write hook: holds the write until released; or fails it on one rank."""

    def __init__(self):
        self.open = threading.Event()
        self.open.set()
        self.fail_on: int | None = None

    def __call__(self) -> None:
        if self.fail_on == dist.get_rank():
            raise OSError(28, "No space left on device")
        assert self.open.wait(60), "the gate was never opened"


def _cases(root: str) -> dict:
    groups.init("gloo", timeout_s=60)
    rank = dist.get_rank()
    model, opt = _model(rank, 0)
    gate = _Gate()
    w = Writer(root, keep=1, background=True, timeout_s=60, during_write=gate)
    snaps = Path(root) / "snapshots"
    got: dict = {}
    try:
        w.save(1, model, opt, META, background=False)
        got["sync"] = read_manifest(snaps / "step_00000001").params_sha256
        got["live"] = collective.model_params_sha256(model)
        _in_flight(w, model, opt, gate, snaps, got)
        _abandoned(w, model, opt, gate, snaps, got)
        _failed(w, model, opt, gate, snaps, got)
    finally:
        groups.destroy()
    return got


def _in_flight(w: Writer, model, opt, gate: _Gate, snaps: Path, got: dict) -> None:
    at_call = {k: v.clone() for k, v in model.state_dict().items()}
    gate.open.clear()
    writing = w.save(2, model, opt, META)
    got["returned_while_held"] = not writing.done()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # training goes on after the call
    got["while_held"] = sorted(os.listdir(snaps))
    try:
        w.save(3, model, opt, META)
    except RuntimeError as exc:
        got["second"] = str(exc)
    gate.open.set()
    ended = w.settle(60)
    got["ended"] = (ended.error, ended.abandoned)
    dist.barrier()
    got["after"] = sorted(os.listdir(snaps))
    fresh, fresh_opt = _model(dist.get_rank(), 100)
    collective.load(find_latest(snaps.parent), fresh, fresh_opt)
    got["holds_the_call"] = all(torch.equal(fresh.state_dict()[k], v) for k, v in at_call.items())


def _abandoned(w: Writer, model, opt, gate: _Gate, snaps: Path, got: dict) -> None:
    gate.open.clear()
    writing = w.save(4, model, opt, META)
    got["abandon"] = writing.abandon()
    gate.open.set()
    ended = w.settle(60)
    got["abandoned"] = (ended.error, ended.abandoned)
    dist.barrier()
    got["after_abandon"] = (sorted(os.listdir(snaps)), read_pointer(snaps))


def _failed(w: Writer, model, opt, gate: _Gate, snaps: Path, got: dict) -> None:
    gate.fail_on = 1
    w.save(5, model, opt, META)
    ended = w.settle(60)
    got["failed"] = ended.error
    dist.barrier()
    got["after_failure"] = (sorted(os.listdir(snaps)), read_pointer(snaps))


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[int, dict]:
    return agent.launch(_cases, 2, str(tmp_path_factory.mktemp("writer")))


def test_params_sha256_is_read_back_from_the_files_and_equals_the_live_models(cases):
    assert cases[0]["sync"] == cases[0]["live"] == cases[1]["live"]


def test_a_background_snapshot_returns_at_once_and_holds_the_state_at_the_call(cases):
    for rank in (0, 1):
        got = cases[rank]
        assert got["returned_while_held"]
        assert "in flight" in got["second"]  # at most one in flight
        assert got["ended"] == (None, False)
        assert got["holds_the_call"]
    # keep 1: the complete snapshot stays until the one in flight is complete
    assert cases[0]["while_held"] == [".tmp-step_00000002", "LATEST", "step_00000001"]
    assert cases[0]["after"] == ["LATEST", "step_00000002"]


def test_an_abandoned_snapshot_is_never_marked_complete(cases):
    assert cases[0]["abandon"] is True
    assert cases[0]["abandoned"] == (None, True)
    assert cases[1]["abandoned"] == (None, False)  # rank 1 wrote its part; only rank 0 commits
    names, latest = cases[0]["after_abandon"]
    assert latest == "step_00000002" and "step_00000004" not in names


def test_a_write_failing_on_one_rank_fails_on_every_rank_and_leaves_no_folder(cases):
    for rank in (0, 1):
        assert "No space left on device" in cases[rank]["failed"], cases[rank]["failed"]
    names, latest = cases[0]["after_failure"]
    assert names == ["LATEST", "step_00000002"] and latest == "step_00000002"
