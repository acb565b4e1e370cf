"""Snapshots of sharded runs stay layout-free (DCP reshards on load).

A tied GPT trains 3 steps under shard 2 × pp 2 (FSDP2 on each stage), snapshots, and goes on to
step 6; the snapshot then resumes under dp 2 (DDP), under pp 2 and under shard 4, and each
resumed step's loss equals the run that never stopped. The same from tp 2 × pp 2 (tensor
parallel: DTensors split over the tp dimension) to dp 2, pp 2 and tp 2 alone, and for a mixture
of 4 experts from ep 2 × shard 2 × pp 2 (the experts DTensors split over ep, sharded over what
is left) to DDP with the experts whole, to ep 2 alone and to shard 4 × ep 4.
"""

import pytest

from brigade.config import ParallelConfig
from brigade.data.chars import load_text_data
from brigade.launcher import agent, groups
from brigade.snapshot.format import find_latest
from tests.snapshot.test_ties import _resume, _save, _steps, _trainer

LAYOUTS = {"shard2xpp2": ParallelConfig(nproc=4, pp=2, dp=2, shard=2, microbatches=2),
           "dp2": ParallelConfig(nproc=2, dp=2),
           "pp2": ParallelConfig(nproc=2, pp=2, dp=1, microbatches=2),
           "shard4": ParallelConfig(nproc=4, dp=4, shard=4),
           "tp2xpp2": ParallelConfig(nproc=4, pp=2, dp=1, tp=2, microbatches=2),
           "tp2": ParallelConfig(nproc=2, dp=1, tp=2),
           "moe-ep2xshard2xpp2": ParallelConfig(nproc=4, pp=2, dp=2, shard=2, ep=2, microbatches=2),
           "moe-dp2": ParallelConfig(nproc=2, dp=2),
           "moe-ep2": ParallelConfig(nproc=2, dp=2, ep=2),
           "moe-shard4xep4": ParallelConfig(nproc=4, dp=4, shard=4, ep=4)}


def _leg(layout: str, root: str, save: bool) -> list[float]:
    """Worker: steps 4-6 of `layout`, from the snapshot in root (save: first train to 3 and save it)."""
    vocab, train, _ = load_text_data("", 32, 0.1)
    groups.init(threads=1)
    trainer = _trainer(LAYOUTS[layout], train, len(vocab), experts=4 if layout.startswith("moe-") else 0)
    if save:
        _steps(trainer, 3)
        _save(trainer, root)
    else:
        _resume(trainer, root)
    got = _steps(trainer, 6)
    trainer.close()
    groups.destroy()
    return got


def _saved_then_resumed(root: str, saved: str, resumed: tuple[str, ...]) -> None:
    """Train `saved` to step 3, snapshot, go on to 6; each of `resumed` from the snapshot must
    give the same losses for steps 4-6."""
    want = agent.launch(_leg, LAYOUTS[saved].nproc, saved, root, True)[0]
    assert len(want) == 3 and find_latest(root).manifest.step == 3
    for layout in resumed:
        got = agent.launch(_leg, LAYOUTS[layout].nproc, layout, root, False)[0]
        assert got == pytest.approx(want, abs=1e-5), layout


@pytest.mark.timeout(300)
def test_a_sharded_snapshot_resumes_under_ddp_pp_and_another_shard(tmp_path):
    _saved_then_resumed(str(tmp_path / "snap"), "shard2xpp2", ("dp2", "pp2", "shard4"))


@pytest.mark.timeout(300)
def test_an_expert_parallel_snapshot_resumes_under_other_expert_degrees(tmp_path):
    _saved_then_resumed(str(tmp_path / "snap"), "moe-ep2xshard2xpp2",
                        ("moe-dp2", "moe-ep2", "moe-shard4xep4"))


@pytest.mark.timeout(300)
def test_a_tensor_parallel_snapshot_resumes_under_dp_pp_and_tp_alone(tmp_path):
    _saved_then_resumed(str(tmp_path / "snap"), "tp2xpp2", ("dp2", "pp2", "tp2"))
