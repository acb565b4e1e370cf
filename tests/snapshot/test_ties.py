"""A shared parameter is stored once and resumes under any layout.

Pure tests for the key rewriting; one launch of 2 gloo processes trains a tied GPT under pp 2,
snapshots it, resumes it under dp 2 (which snapshots again), then under pp 2 interleaved (two
stages per rank): every resumed step's loss equals the run that went on without stopping.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from brigade.config import OptimConfig, ParallelConfig, RunConfig, TrainConfig
from brigade.data.chars import load_text_data
from brigade.launcher import agent, groups
from brigade.models.gpt import GPTConfig, gpt, gpt_loss
from brigade.snapshot import collective, writer
from brigade.snapshot.compat import run_facts
from brigade.snapshot.format import find_latest
from brigade.snapshot.ties import aliases_of, canonical_key, filled, stored, to_load
from brigade.train.trainer import Trainer

TIED = {"blocks.3.out.weight": "blocks.0.tok.weight"}


def test_keys_of_an_alias_map_to_the_canonical_name():
    assert canonical_key("blocks.3.out.weight", TIED) == "blocks.0.tok.weight"
    assert canonical_key("state.blocks.3.out.weight.exp_avg", TIED) == "state.blocks.0.tok.weight.exp_avg"
    assert canonical_key("param_groups.blocks.3.out.weight.lr", TIED) == "param_groups.blocks.0.tok.weight.lr"
    assert canonical_key("blocks.3.out.weight_extra", TIED) is None  # a prefix of a name is not the name
    assert canonical_key("blocks.0.tok.weight", TIED) is None


def test_a_snapshot_drops_aliases_and_a_loader_fills_them():
    a, b = torch.ones(2), torch.zeros(2)
    assert stored({"blocks.0.tok.weight": a, "blocks.3.out.weight": b}, TIED) == {"blocks.0.tok.weight": a}
    # both held: read the canonical entry once, give the alias its value
    read, fill = to_load({"blocks.0.tok.weight": a, "blocks.3.out.weight": b}, TIED)
    assert list(read) == ["blocks.0.tok.weight"] and read["blocks.0.tok.weight"] is a
    both = filled(read, fill)
    assert torch.equal(both["blocks.3.out.weight"], a) and both["blocks.0.tok.weight"] is a
    # only the alias held (the last stage): the canonical entry is read into the alias's tensor
    read, fill = to_load({"blocks.3.out.weight": b, "state.blocks.3.out.weight.step": 1}, TIED)
    assert read == {"blocks.0.tok.weight": b, "state.blocks.0.tok.weight.step": 1}
    assert filled(read, fill) == {"blocks.3.out.weight": b, "state.blocks.3.out.weight.step": 1}


def test_two_copies_on_one_rank_get_optimizer_states_of_their_own():
    """A V placement holds the embedding's stage and the head's on one rank: were both handed one
    `exp_avg` and one `step`, each optimizer step would update them twice."""
    state = {"state.blocks.0.tok.weight.step": torch.tensor(4.0), "state.blocks.3.out.weight.step":
             torch.tensor(4.0), "param_groups.blocks.0.tok.weight.lr": 0.1,
             "param_groups.blocks.3.out.weight.lr": 0.1}
    read, fill = to_load(state, TIED)
    both = filled(read, fill)
    tok, out = both["state.blocks.0.tok.weight.step"], both["state.blocks.3.out.weight.step"]
    assert tok is not out and torch.equal(tok, out)
    assert both["param_groups.blocks.3.out.weight.lr"] == 0.1
    # a tie used by three stages, two of them here without the first: one tensor each as well
    three = {**TIED, "blocks.5.out.weight": "blocks.0.tok.weight"}
    read, fill = to_load({"blocks.3.out.weight": torch.ones(2), "blocks.5.out.weight": torch.ones(2)}, three)
    held = filled(read, fill)
    assert sorted(held) == ["blocks.3.out.weight", "blocks.5.out.weight"]
    assert held["blocks.3.out.weight"] is not held["blocks.5.out.weight"]


def test_aliases_are_found_by_identity_and_declared():
    blocks = gpt(GPTConfig(10, 8, n_layer=1, n_head=2, n_embd=8))
    assert aliases_of(nn.ModuleList(blocks)) == {"2.out.weight": "0.tok.weight"}
    plain = nn.Linear(2, 2)
    plain.aliases = {"weight_copy": "weight"}
    assert aliases_of(plain) == {"weight_copy": "weight"}


def _trainer(par: ParallelConfig, train, vocab: int, experts: int = 0) -> Trainer:
    torch.manual_seed(0)
    blocks = gpt(GPTConfig(vocab, 32, n_layer=2, n_head=2, n_embd=32, experts=experts))
    return Trainer(blocks, gpt_loss, train, None, parallel=par, optim=OptimConfig(warmup_steps=2),
                   train=TrainConfig(max_steps=8, batch_size=8), metrics=False)


def _steps(trainer: Trainer, until: int) -> list[float]:
    trainer.model.train()
    return [trainer.train_step()["loss"] for _ in range(trainer.state.step, until)]


def _save(trainer: Trainer, out) -> None:
    sampler = trainer.sampler
    facts = run_facts(RunConfig(parallel=trainer.parallel), sampler.cursor, sampler.epoch, None)
    writer.save(out, trainer.state.step, trainer.model, trainer.optimizer, facts)


def _resume(trainer: Trainer, out) -> None:
    manifest = collective.load(find_latest(out), trainer.model, trainer.optimizer)
    trainer.state.step, trainer.sampler.cursor = manifest.step, manifest.cursor


def _copies(trainer: Trainer) -> dict[str, str]:
    """Every parameter's hash under every name this rank holds, gathered from all ranks."""
    from brigade.snapshot.format import tensor_sha256

    mine = {n: tensor_sha256(p) for n, p in trainer.model.named_parameters(remove_duplicate=False)}
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def _moves(root: str) -> dict:
    """pp 2 → snapshot at 3 → dp 2 → snapshot at 5 → pp 2 interleaved; losses of each leg."""
    vocab, train, _ = load_text_data("", 32, 0.1)
    groups.init(threads=1)
    pp2 = ParallelConfig(nproc=2, pp=2, dp=1, microbatches=2)
    dp2 = ParallelConfig(nproc=2, pp=1, dp=2)
    inter = ParallelConfig(nproc=2, pp=2, dp=1, microbatches=2, schedule="interleaved")
    got: dict = {}
    a = _trainer(pp2, train, len(vocab))
    _steps(a, 3)
    _save(a, f"{root}/a")
    got["pp2"] = _steps(a, 8)
    a.close()
    b = _trainer(dp2, train, len(vocab))
    _resume(b, f"{root}/a")
    got["dp2_from_pp2"] = _steps(b, 5)
    _save(b, f"{root}/b")
    got["dp2"] = _steps(b, 8)
    b.close()
    c = _trainer(inter, train, len(vocab))
    _resume(c, f"{root}/b")
    got["interleaved_from_dp2"] = _steps(c, 8)
    got["copies"] = _copies(c)
    c.close()
    groups.destroy()
    return got


@pytest.mark.timeout(300)
def test_a_tied_gpt_resumes_across_layouts(tmp_path):
    got = agent.launch(_moves, 2, str(tmp_path))[0]
    assert got["dp2_from_pp2"] == pytest.approx(got["pp2"][:2], abs=1e-5)  # steps 4, 5
    assert got["interleaved_from_dp2"] == pytest.approx(got["dp2"], abs=1e-5)  # steps 6, 7, 8
    assert got["dp2"] == pytest.approx(got["pp2"][2:], abs=1e-5)
    assert got["copies"]["blocks.3.out.weight"] == got["copies"]["blocks.0.tok.weight"]
    # stored once: no alias among the snapshot's keys, model or optimizer
    for leg in ("a", "b"):
        keys = collective.SafeReader(find_latest(tmp_path / leg).path).read_metadata().state_dict_metadata
        assert "model.blocks.0.tok.weight" in keys and "optim.state.blocks.0.tok.weight.exp_avg" in keys
        assert not [k for k in keys if "blocks.3.out" in k], leg
