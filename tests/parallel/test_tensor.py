"""Tensor parallel from outside (brigade/parallel/tensor.py): plans checked before any process
starts, and applied: the planned weights become DTensors of half their size on each of 2
processes, and a block whose attention splits its heads the wrong way fails the check.

The equality with one device under every schedule is tests/check/test_run.py's (tensor parallel
grids) and tests/train/test_trainer.py's (20 steps); this file is about the plans themselves.
"""

import pytest
import torch.nn.functional as F
from torch import nn

from brigade.errors import BrigadeError
from brigade.models.gpt import GPTConfig, gpt
from brigade.parallel.tensor import check_plans, plan_of


def _tiny_gpt(n_head: int = 2):
    return gpt(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=n_head, n_embd=8))


def test_the_gpt_ships_a_plan_for_every_block():
    embedding, block, head = _tiny_gpt()
    assert plan_of(embedding) == {} and plan_of(head) == {}
    assert plan_of(block) == {"attn.qkv": ("colwise", 2), "attn.proj": ("rowwise", 2),
                              "mlp.0": "colwise", "mlp.2": "rowwise",
                              "ln1": "sequence", "ln2": "sequence", "attn": "gather", "mlp": "gather"}
    check_plans(_tiny_gpt(), 2)  # 2 heads of 4, hidden 32: tp 2 divides both


def test_tp_1_needs_no_plan():
    check_plans([nn.Linear(3, 3)], 1)


class _Planned(nn.Module):
    def __init__(self, plan):
        super().__init__()
        self.fc, self.act = nn.Linear(4, 6), nn.ReLU()
        self.tp_plan = plan


@pytest.mark.parametrize("blocks, tp, message", [
    ([nn.Linear(4, 4)], 2, "block 0 (Linear) of m has no tensor-parallel plan, so --tp 2 cannot split it: "
                           "give the block a tp_plan"),
    ([_Planned({"fc": "diagonal"})], 2, "block 0 (_Planned) of m's tp_plan gives fc the style diagonal: "
                                        "expected 'colwise', 'rowwise', (style, units) like ('colwise', 4), "
                                        "'vocab', 'sequence', 'gather', 'whole' or 'per-head'"),
    ([_Planned({"act": ("sequence", 2)})], 2, "gives act the style sequence: expected"),
    ([_Planned({"norm": "sequence"})], 2, "tp_plan names 'norm', which the block does not have"),
    ([_Planned({"fc": ("colwise", "x")})], 2, "gives fc the style ('colwise', 'x')"),
    ([_Planned({"out": "colwise"})], 2, "tp_plan names 'out', which the block does not have"),
    ([_Planned({"act": "colwise"})], 2, "tp_plan splits act, a ReLU: tensor parallel splits nn.Linear and "
                                        "nn.Embedding only"),
    ([_Planned({"fc": "colwise"})], 4, "fc's 6 output features do not split evenly over --tp 4: use a --tp "
                                       "that divides 6"),
    ([_Planned({"fc": "rowwise"})], 3, "fc's 4 input features do not split evenly over --tp 3"),
    ([_Planned({"fc": ("colwise", 3)})], 2, "fc splits into 3 heads (or groups), which --tp 2 does not "
                                            "divide: use a --tp that divides 3"),
    (_tiny_gpt(n_head=1), 2, "block 1 (Block) of m: attn.qkv splits into 1 heads"),
])
def test_a_plan_that_cannot_split_is_one_line(blocks, tp, message):
    with pytest.raises(BrigadeError) as err:
        check_plans(blocks, tp, "m")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_model_file_gives_plans_by_block_index(tmp_path):
    from brigade.models import load_model

    f = tmp_path / "m.py"
    f.write_text("from torch import nn\n"
                 "def make():\n    return [nn.Linear(4, 6), nn.Linear(6, 4)]\n"
                 "tp_plan = {0: {'': 'colwise'}, 1: {'': 'rowwise'}}\n")
    spec = load_model(f"{f}:make")
    assert [plan_of(b) for b in spec.blocks] == [{"": "colwise"}, {"": "rowwise"}]
    check_plans(spec.blocks, 2)
    f.write_text("from torch import nn\ndef make():\n    return [nn.Linear(4, 6)]\ntp_plan = {3: {}}\n")
    with pytest.raises(BrigadeError, match="tp_plan names block 3 but the model has 1 blocks"):
        load_model(f"{f}:make")


def _shapes(sequence: bool) -> dict:
    """Worker: a tiny GPT block split over 2 processes; its planned weights' local shapes."""
    from torch.distributed.device_mesh import init_device_mesh

    from brigade.launcher import groups
    from brigade.parallel.tensor import is_tp_sharded, parallelize

    groups.init("gloo", threads=1)
    blocks = _tiny_gpt()
    parallelize(blocks, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), sequence)
    out = {n: (tuple(p.to_local().shape) if hasattr(p, "to_local") else None, is_tp_sharded(p))
           for n, p in blocks[1].named_parameters()}
    out["embedding"] = [type(p).__name__ for p in blocks[0].parameters()]
    groups.destroy()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sequence", [True, False], ids=["sequence-parallel", "off"])
def test_planned_weights_are_split_in_half_and_the_rest_stays_whole(sequence):
    from brigade import launch

    got = launch(_shapes, 2, sequence)[0]
    assert got["attn.qkv.weight"] == ((12, 8), True)  # 3 × 8 rows: a head's q, k, v on each process
    assert got["attn.proj.weight"] == ((8, 4), True)  # its input columns: the heads held here
    assert got["attn.proj.bias"] == ((8,), False)  # added once, after the partial sums
    assert got["mlp.0.weight"] == ((16, 8), True) and got["mlp.2.weight"] == ((8, 16), True)
    # whole on both: a DTensor replicated over tp under sequence parallel, else a plain tensor
    assert got["ln1.weight"] == (((8,), False) if sequence else (None, False))
    assert got["embedding"] == ["Parameter", "Parameter"]


def _contiguous_split(self, x, documents=None):
    """GPT attention reading q, k and v as three contiguous thirds of qkv: right on one device
    (another, equally valid, layout of the weight), wrong when tp splits its rows by heads."""
    b, t, _ = x.shape
    qkv = self.qkv(x)
    q, k, v = qkv.split(qkv.shape[-1] // 3, dim=2)
    q, k, v = (z.reshape(b, t, -1, self.d).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.proj(y.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.timeout(120)
def test_the_check_fails_when_heads_are_split_across_q_k_and_v(monkeypatch):
    """The check can fail: with q, k, v as contiguous thirds, tp 2's first process gets all of q and
    half of k, and the result no longer equals one device."""
    from brigade.check.run import CheckConfig, run_check
    from brigade.models.gpt import SelfAttention

    monkeypatch.setattr(SelfAttention, "forward", _contiguous_split)
    cfg = CheckConfig(model="gpt", stages=1, batch_size=4, tp=2,
                      model_options={"gpt_cfg": GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8)})
    (result,) = run_check(cfg, [("1f1b", 1, 1)])
    assert not result["ok"] and result["max_abs_loss_diff"] > 1e-4, result
    assert result["tp"] == 2


STRUCTURED = '''
import torch
from torch import nn


class Split(nn.Module):  # (B, 6) -> {"h": (B, 8), "skip": (B, 8)}
    tp_plan = {"up": "colwise", "down": "rowwise"}

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(6, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.down(torch.tanh(self.up(x)))
        return {"h": torch.tanh(h), "skip": 2 * h}


class Pair(nn.Module):  # dict -> (h, skip): the skip passes through
    tp_plan = {"up": "colwise", "down": "rowwise"}

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return torch.tanh(self.down(torch.relu(self.up(x["h"])))), x["skip"]


class Join(nn.Module):  # (h, skip) -> (B, 3), whole on every tp process
    tp_plan = {}

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x):
        h, skip = x
        return self.lin(h * skip)


def model():
    return [Split(), Pair(), Join(), nn.Linear(3, 3)]


tp_plan = {3: {}}  # the last block, a bare Linear, is given its (empty) plan by the file
'''


@pytest.mark.timeout(200)
def test_structures_cross_tensor_parallel_stages_and_recompute(tmp_path):
    """tp 2 × pp 2 (4 processes): a dict and a tuple cross the stages between split blocks, a skip's
    gradient crosses two, under a whole and a split backward, full and selective recompute, and
    a V schedule; each equals one device."""
    from brigade.check.run import CheckConfig, run_check

    f = tmp_path / "chain.py"
    f.write_text(STRUCTURED)
    cases = [("1f1b", 2, 1, "none"), ("zb", 2, 1, "selective"), ("zbv", 2, 2, "full")]
    results = run_check(CheckConfig(model=f"{f}:model", stages=2, batch_size=8, tp=2), cases)
    for r, (schedule, m, v, mode) in zip(results, cases, strict=True):
        got = (r["schedule"], r["microbatches"], r["virtual"], r["recompute"], r["tp"])
        assert got == (schedule, m, v, mode, 2)
        worst = max(r["max_abs_loss_diff"], r["max_abs_grad_diff"], r["max_abs_param_diff"])
        assert r["ok"] and worst < 1e-5, r
