"""Activation recompute (brigade/parallel/recompute.py) in one process, no group.

Full and selective recompute give the very gradients of keeping everything (dropout included),
under a plain and a split backward; a block's forward runs again once per micro-batch, where
torch's checkpoint runs it once per backward call (more under I then W); selective replays the
matmuls; and a block or model file names its own mode.
"""

import copy

import pytest
import torch
from torch import nn

from brigade.errors import BrigadeError
from brigade.models import load_model
from brigade.models.gpt import GPTConfig, gpt, gpt_loss
from brigade.parallel import recompute
from brigade.pipeline.runtime.backward import backward_split

CFG = GPTConfig(50, 16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    blocks = gpt(CFG)
    x, y = torch.randint(50, (4, 16)), torch.randint(50, (4, 16))
    return blocks, blocks[0](x).detach(), y  # from block 1 on: a stage whose input needs a gradient


def _grads(setup, mode: str, split: bool) -> tuple[list, int]:
    """Gradients (the input's last) of blocks 1.. under `mode`, and how many forwards ran again."""
    blocks, h0, y = setup
    stage = nn.Sequential(*copy.deepcopy(blocks[1:]))
    recompute.apply(list(stage), mode)
    before = recompute.reruns()
    h = h0.clone().requires_grad_(True)
    torch.manual_seed(5)  # the dropout masks
    loss = gpt_loss(stage(h), y)
    if split:
        dx, weights = backward_split(loss, None, h, list(stage.parameters()))
        weights(None)
    else:
        loss.backward()
        dx = h.grad
    return [p.grad for p in stage.parameters()] + [dx], recompute.reruns() - before


@pytest.mark.parametrize("split", [False, True], ids=["B", "I+W"])
@pytest.mark.parametrize("mode", ["full", "selective", "op"])
def test_recompute_gives_the_gradients_of_keeping_everything_once_per_block(setup, mode, split):
    want, none = _grads(setup, "none", split)
    got, count = _grads(setup, mode, split)
    assert none == 0 and count == len(setup[0]) - 1  # once per block, I and W sharing it
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_torchs_checkpoint_recomputes_again_for_the_weight_pass(setup):
    """Why recompute is brigade's own: torch.utils.checkpoint keys its recompute by the backward
    call, so the weight pass of a split backward runs every block's forward again (once per call
    the weight pass makes)."""
    blocks, h0, y = setup
    stage = copy.deepcopy(blocks[1:3])  # two transformer blocks
    runs = [0]

    def counting(block):
        inner = block.forward

        def forward(x):
            runs[0] += 1
            return inner(x)
        return forward

    fns = [counting(b) for b in stage]
    h = h0.clone().requires_grad_(True)
    out = h
    for fn in fns:
        out = torch.utils.checkpoint.checkpoint(fn, out, use_reentrant=False)
    runs[0] = 0
    dx, weights = backward_split(out.square().mean(), None, h, [p for b in stage for p in b.parameters()])
    weights(None)
    assert runs[0] >= 2 * len(stage)  # torch 2.13: 7 runs a block (one per weight-pass call)


def test_selective_replays_matmuls_and_recomputes_the_rest(setup, monkeypatch):
    ran: list = []
    real = recompute._Replay.__torch_dispatch__

    def seen(self, func, types, args=(), kwargs=None):
        if not recompute.kept(func, args, kwargs or {}):
            ran.append(func.overloadpacket)
        return real(self, func, types, args, kwargs)

    monkeypatch.setattr(recompute._Replay, "__torch_dispatch__", seen)
    _grads(setup, "selective", split=False)
    assert ran and not {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm} & set(ran)


def test_op_runs_every_second_matmul_again_and_replays_the_others(setup, monkeypatch):
    """torchtitan's "op" policy: of a block's matmuls the 1st, 3rd, … are replayed, the 2nd, 4th, …
    run again in the recompute."""
    calls: list = []
    real = recompute._Replay.__torch_dispatch__

    def seen(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in recompute.MATMULS:
            calls.append(func.overloadpacket)
        return real(self, func, types, args, kwargs)

    ran: list = []
    original = recompute._Record.__torch_dispatch__

    def noted(self, func, types, args=(), kwargs=None):
        out = original(self, func, types, args, kwargs)
        if func.overloadpacket in recompute.MATMULS:
            ran.append(self.outputs[-1] is None)
        return out

    monkeypatch.setattr(recompute._Replay, "__torch_dispatch__", seen)
    monkeypatch.setattr(recompute._Record, "__torch_dispatch__", noted)
    _grads(setup, "op", split=False)
    per_block = len(ran) // (len(setup[0]) - 1)
    assert per_block >= 2 and ran[:per_block] == [k % 2 == 1 for k in range(per_block)]
    assert len(calls) == len(ran)  # every matmul reaches the replay: half replayed, half run


def test_a_block_declares_its_own_mode_and_a_bad_one_is_named():
    blocks = [nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)]
    blocks[1].recompute = "none"
    assert recompute.apply(blocks, "full") == ["full", "none", "full"]
    assert isinstance(blocks[0].forward, recompute.Recomputed)
    assert "forward" not in vars(blocks[1])
    blocks[2].recompute = "some"
    with pytest.raises(BrigadeError, match=r"block 2 \(Linear\) declares recompute 'some': expected one"):
        recompute.modes(blocks, "none")
    with pytest.raises(BrigadeError, match="--recompute 'half': expected one of none, full, selective, op"):
        recompute.modes([nn.Linear(2, 2)], "half")


def test_evaluation_runs_the_block_as_it_is():
    block = nn.Linear(3, 3)
    recompute.apply([block], "full")
    with torch.no_grad():
        assert torch.equal(block(torch.ones(1, 3)), nn.functional.linear(torch.ones(1, 3), block.weight,
                                                                          block.bias))


class _Moody(nn.Module):
    """A block whose forward depends on a counter, not only its input."""

    def __init__(self):
        super().__init__()
        self.lin, self.calls = nn.Linear(3, 3), 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x).tanh() if self.calls == 1 else self.lin(x)


def test_a_forward_that_changes_between_runs_is_refused_naming_the_block():
    block = _Moody()
    recompute.apply([block], "full")
    loss = block(torch.ones(2, 3, requires_grad=True)).sum()
    with pytest.raises(BrigadeError, match=r"block 0 \(_Moody\) saved \d tensors .* and \d when recomputed"):
        loss.backward()


MODEL_FILE = """
from torch import nn
recompute = {RECOMPUTE}


def make():
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
"""


@pytest.mark.parametrize("plan,message", [
    ("{0: 'none', 1: 'selective'}", None),
    ("{2: 'full'}", "recompute names block 2 but the model has 2 blocks (0 to 1)"),
    ("['full']", "recompute is a list: expected a dict like"),
])
def test_a_model_files_recompute_names_its_blocks(tmp_path, plan, message):
    path = tmp_path / "m.py"
    path.write_text(MODEL_FILE.replace("{RECOMPUTE}", plan))
    if message is None:
        spec = load_model(f"{path}:make")
        assert recompute.modes(spec.blocks, "full") == ["none", "selective"]
        return
    with pytest.raises(BrigadeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model(f"{path}:make")
