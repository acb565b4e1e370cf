"""A run's mixture-of-experts figures (brigade/train/experts.py, brigade/models/moe.py's `seen`):
two replicas, each holding one of the two layers' stages or both, report the step one process
reports on the whole batch; evaluation forwards and recompute's second forward are not counted;
a run writes the figures to metrics.jsonl and draws experts.png."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from brigade.models.moe import MoE, MoEConfig
from brigade.parallel import recompute
from brigade.train.experts import ExpertStats

C = 8


def _blocks() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(MoE(C, MoEConfig(4, 2, 8, aux_coef=0.01))) for _ in range(2)]


def _batch() -> torch.Tensor:
    return torch.randn(4, 6, C, generator=torch.Generator().manual_seed(1))


def _step(held_by_rank: bool) -> dict:
    """Worker: this rank's half of the batch through the layers it holds (all of them, or the one
    its rank names when `held_by_rank`: each rank a stage of its own, the other's layer not here)."""
    from brigade.launcher import groups

    info = groups.init("gloo", threads=1)
    blocks, rank = _blocks(), torch.distributed.get_rank()
    x = _batch()[2 * rank: 2 * rank + 2]
    if held_by_rank:  # rank 0 runs both layers' forwards on the whole batch, then keeps only its own
        x = _batch()
    for b in blocks:
        x = b(x)
    held = {rank: blocks[rank]} if held_by_rank else dict(enumerate(blocks))
    if held_by_rank and rank == 1:
        blocks[0][0].take_seen()
    if held_by_rank and rank == 0:
        blocks[1][0].take_seen()
    out = ExpertStats(blocks).record(held, info.device)
    groups.destroy()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("held_by_rank", [False, True], ids=["replicas", "stages"])
def test_replicas_and_stages_add_up_to_one_process_on_the_whole_batch(held_by_rank):
    from brigade import launch

    blocks = _blocks()
    x = _batch()
    for b in blocks:
        x = b(x)
    seen = [b[0].take_seen() for b in blocks]
    load = [s[:4] / s[:4].sum() for s in seen]
    aux = sum(float(s[4] / s[5]) for s in seen) / 2
    for rank, got in launch(_step, 2, held_by_rank).items():
        assert got["moe_load"] == [[round(v, 5) for v in row.tolist()] for row in load], rank
        assert got["moe_aux"] == pytest.approx(aux, rel=1e-6) and got["moe_aux"] > 0
        assert 1.0 <= got["moe_imbalance"] <= 4.0 and 0 < got["moe_entropy"] <= 2 ** 0.5


def test_evaluation_and_recompute_are_not_counted_twice():
    (block,) = _blocks()[:1]
    layer = block[0]
    block(_batch()).sum().backward()
    once = layer.take_seen()
    recompute.apply([block], "full")
    block(_batch()).sum().backward()  # the forward, then again inside the backward
    torch.testing.assert_close(layer.take_seen(), once)
    layer.eval()
    with torch.no_grad():
        layer(_batch())
    assert not layer.take_seen().any()


def test_a_run_writes_the_figures_and_draws_them(tmp_path):
    from tests.e2e.helpers import brigade

    out = tmp_path / "run"
    done = brigade("train", "--out", str(out), "--experts", "4", "--top-k", "2", "--max-steps", "3",
                   "--nproc", "2", "--pp", "2", "--n-layer", "2", "--n-embd", "32", "--block-size", "16",
                   "--context", "16", "--eval-every", "2", "--sample-tokens", "0")
    assert done.returncode == 0, done.stderr[-2000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "moe_load" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(len(r["moe_load"]) == 2 and sum(r["moe_load"][0]) == pytest.approx(1, abs=1e-4) for r in steps)
    assert (out / "experts.png").stat().st_size > 0
