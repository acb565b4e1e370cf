"""One rank's memory by kind (brigade/train/memory.py): storages counted once, a step measured in one
process, and a sharded layout holding half the states of DDP on each of 2 ranks."""

import pytest
import torch
from torch import nn

from brigade.config import OptimConfig, ParallelConfig, TrainConfig
from brigade.data.chars import load_text_data
from brigade.launcher import agent, groups
from brigade.models.gpt import GPTConfig, gpt, gpt_loss
from brigade.train.memory import StepMemory, storage_bytes
from brigade.train.trainer import Trainer


def test_storages_are_counted_once_however_many_tensors_view_them():
    a = torch.zeros(10, 10)
    assert storage_bytes([a, a[2:], a.t(), None]) == 400
    assert storage_bytes([a, torch.zeros(5, dtype=torch.float64)]) == 440
    assert storage_bytes([torch.zeros(0)]) == 0


def test_a_step_measured_in_one_process():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    params = list(model.parameters())
    nbytes = sum(p.numel() * 4 for p in params)
    for _ in range(2):  # measure the second: its optimizer state exists when it begins
        with StepMemory(params, opt, torch.device("cpu")) as mem:
            model(torch.randn(32, 64)).square().mean().backward()
            mem.grads_ready([p.grad for p in params])
            opt.step()
            opt.zero_grad(set_to_none=True)
    got = mem.report()
    assert got["params"] == got["grads"] == nbytes
    assert got["optimizer"] == 2 * nbytes + 4 * len(params)  # exp_avg, exp_avg_sq, a float step each
    # the input (saved by the first Linear), tanh's output (by tanh and the second Linear: one
    # storage), the output (by square); the weights' views are the parameters'
    assert got["activations"] == (32 * 64 + 32 * 256 + 32 * 64) * 4
    assert got["peak"] >= got["params"] + got["grads"] + got["optimizer"] + got["activations"]
    assert got["counted"] == "storages"


def _reports(shard: int) -> list[dict]:
    """Worker: 2 steps of a tiny GPT over the world (dp 2), DDP or sharded; every rank's memory."""
    vocab, train, _ = load_text_data("", 32, 0.1)
    torch.manual_seed(0)
    blocks = gpt(GPTConfig(len(vocab), 32, n_layer=2, n_head=2, n_embd=64, dropout=0.0))
    groups.init(threads=1)
    par = ParallelConfig(nproc=2, dp=2, shard=shard)
    trainer = Trainer(blocks, gpt_loss, train, None, parallel=par, optim=OptimConfig(warmup_steps=1),
                      train=TrainConfig(max_steps=2, batch_size=8), metrics=False)
    trainer.fit()
    got = trainer.memory_report
    trainer.close()
    groups.destroy()
    return got


@pytest.mark.timeout(180)
def test_shard_2_holds_half_the_states_of_ddp_on_each_rank():
    ddp = agent.launch(_reports, 2, 1)[0]
    fsdp = agent.launch(_reports, 2, 2)[0]
    for kind in ("params", "grads", "optimizer"):
        total = ddp[0][kind]
        assert [r[kind] for r in ddp] == [total, total]
        # each rank a half, give or take the padding of an odd first dimension
        assert all(total / 2 - 4096 <= r[kind] <= total / 2 + 4096 for r in fsdp), (kind, fsdp)
    assert all(r["activations"] > 0 and r["peak"] > r["params"] for r in ddp + fsdp)
