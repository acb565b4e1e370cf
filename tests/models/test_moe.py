"""The mixture-of-experts layer (brigade/models/moe.py): the same outputs and gradients as a token
by token reference for each routing rule; the grouped matmul and the one-matmul-an-expert path
agree; the balancing loss is exact under any cut of the batch and reaches the router only
through the backward; DeepSeek's bias moves the choices, never the weights; bad configurations
are one line; the GPT builds its blocks with it and --tp refuses it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from brigade.errors import BrigadeError
from brigade.models import moe
from brigade.models.gpt import GPTConfig, gpt
from brigade.models.moe import MoE, MoEConfig

C = 16


def _layer(seed: int = 0, **kw) -> MoE:
    torch.manual_seed(seed)
    return MoE(C, MoEConfig(**{"experts": 4, "top_k": 2, "hidden": 8, **kw}))


def _by_token(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer token by token: its chosen experts' SwiGLUs, weighted, and the shared expert."""
    rows = x.reshape(-1, C)
    _, weights, chosen = layer.route(rows)
    out = []
    for r, w, ks in zip(rows, weights, chosen):
        ex, h = layer.experts, layer.experts.hidden
        y = sum(wk * ((F.silu(ex.gate_up_proj[k, :h] @ r) * (ex.gate_up_proj[k, h:] @ r)) @ ex.down_proj[k].T)
                for wk, k in zip(w, ks))
        out.append(y + (layer.shared(r) if layer.shared is not None else 0))
    return torch.stack(out).view(x.shape)


@pytest.mark.parametrize("kw", [{}, {"scores": "sigmoid"}, {"renormalize": False}, {"top_k": 1},
                                {"top_k": 4, "shared_hidden": 8}], ids=str)
def test_the_layer_equals_a_token_by_token_reference(kw):
    layer = _layer(**kw)
    x = torch.randn(3, 5, C, generator=torch.Generator().manual_seed(1), requires_grad=True)
    mine = layer(x)
    theirs = _by_token(layer, x)
    torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-5)
    g = torch.randn_like(mine)
    a = torch.autograd.grad(mine, [x, *layer.parameters()], g)
    b = torch.autograd.grad(theirs, [x, *layer.parameters()], g, allow_unused=True)
    for got, want in zip(a, b):
        torch.testing.assert_close(got, torch.zeros_like(got) if want is None else want, atol=1e-6, rtol=1e-5)


def test_the_grouped_matmul_and_the_loop_agree(monkeypatch):
    layer = _layer()
    x = torch.randn(4, 6, C, generator=torch.Generator().manual_seed(2))
    ex = layer.experts
    assert moe._grouped(x.view(-1, C), ex.gate_up_proj.transpose(1, 2), ex.down_proj.transpose(1, 2))
    grouped = layer(x)
    monkeypatch.setattr(moe, "_grouped", lambda *a: False)
    torch.testing.assert_close(layer(x), grouped, atol=1e-6, rtol=1e-5)


def _router_grad(layer: MoE, pieces: list[torch.Tensor], total: float) -> torch.Tensor:
    layer.zero_grad()
    moe.per_step([layer], total)
    for x in pieces:  # a loss that ignores the router: its gradient is the balancing loss's alone
        (layer(x).sum() * 0 * x.shape[0] / total).backward()
    return layer.gate.weight.grad.clone()


def test_the_balancing_loss_is_the_same_however_the_batch_is_cut():
    layer = _layer(aux_coef=0.1)
    x = torch.randn(6, 5, C, generator=torch.Generator().manual_seed(3))
    whole = _router_grad(layer, [x], 6)
    assert whole.abs().max() > 1e-4  # the router learns from it
    cut = _router_grad(layer, list(x.split([1, 2, 3])), 6)
    torch.testing.assert_close(cut, whole, atol=1e-7, rtol=1e-5)
    last = x[3:]  # what the layer keeps is what its last forward saw
    scores = layer.gate(last.reshape(-1, C)).softmax(-1)
    assert float(layer.aux) > 0 and float(layer.entropy) == pytest.approx(
        float(-(scores * scores.log()).sum(-1).mean()), rel=1e-5)
    assert layer.load.sum() == 3 * 5 * 2 and layer.load.shape == (4,)


def test_a_scaled_loss_scales_the_balancing_loss_alike():
    """Under fp16's loss scale (65536) the step's sequences are told divided by it: the balancing
    loss's gradient is scaled as the loss's is (and unscaled with it), not dropped to one
    forward's own share by a count rounded to 0."""
    layer = _layer(aux_coef=0.1)
    x = torch.randn(6, 5, C, generator=torch.Generator().manual_seed(3))
    plain = _router_grad(layer, [x], 6)
    torch.testing.assert_close(_router_grad(layer, [x], 6 / 65536), plain * 65536, rtol=1e-5, atol=1e-7)


def test_the_balancing_loss_reaches_the_router_as_its_own_gradient():
    layer = _layer(aux_coef=0.5)
    x = torch.randn(2, 4, C, generator=torch.Generator().manual_seed(4))
    layer(x).sum().backward()
    mine = layer.gate.weight.grad.clone()
    layer.zero_grad()
    plain = copy.deepcopy(layer)
    plain.cfg = MoEConfig(4, 2, 8)  # no balancing loss
    rows = x.view(-1, C)
    scores, _, chosen = layer.route(rows)
    (plain(x).sum() + 0.5 * layer._aux(scores, chosen, x.shape)).backward()
    both = plain.gate.weight.grad + layer.gate.weight.grad
    torch.testing.assert_close(mine, both, atol=1e-6, rtol=1e-5)


def test_the_bias_moves_choices_towards_idle_experts_and_never_the_weights():
    layer = _layer(bias_rate=1.0)
    x = torch.randn(2, 4, C, generator=torch.Generator().manual_seed(5))
    layer.update_bias(torch.tensor([10.0, 0.0, 5.0, 5.0]))
    assert layer.bias.tolist() == [-1.0, 1.0, 0.0, 0.0]
    layer.bias.copy_(torch.tensor([0.0, 100.0, 0.0, 0.0]))
    scores, weights, chosen = layer.route(x.view(-1, C))
    assert (chosen == 1).any(-1).all()  # every token takes the favoured expert
    picked = scores.gather(-1, chosen)
    torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True))
    assert "bias" in layer.state_dict() and "bias" not in _layer().state_dict()  # kept only where it moves


@pytest.mark.parametrize("kw, message", [({"top_k": 5}, "top-k 5 of 4 experts"),
                                         ({"scores": "relu"}, "router scores 'relu'")])
def test_a_bad_configuration_is_one_line(kw, message):
    with pytest.raises(ValueError, match=message):
        _layer(**kw)


def test_the_gpt_builds_mixture_of_experts_blocks_whole_under_tensor_parallel():
    """The mixture runs whole on every tp process ("whole"); a plan that leaves it out is refused."""
    from brigade.parallel.tensor import check_plans

    blocks = gpt(GPTConfig(n_layer=2, n_embd=C, n_head=2, block_size=8, experts=4, top_k=2))
    assert all(isinstance(b.mlp, MoE) for b in blocks[1:-1])
    assert "mlp.0" not in blocks[1].tp_plan and blocks[1].tp_plan["mlp"] == "whole"
    check_plans(blocks, 2)
    del blocks[1].tp_plan["mlp"]
    with pytest.raises(BrigadeError, match=r"block 1 \(Block\) of the model has a mixture of experts \(mlp\) "
                                           r"its tp_plan does not name: give it \{'mlp': 'whole'\}"):
        check_plans(blocks, 2)


@pytest.mark.slow
def test_compiled_the_balancing_loss_still_reaches_the_router():
    """AOTAutograd replays an output that views an input outside its graph: `_AddAux` returning a
    view lost its backward there (the router's gradient 1e-3 off); compiled, it returns a copy."""
    layer = _layer(aux_coef=0.01)
    compiled = copy.deepcopy(layer)
    compiled.forward = torch.compile(compiled.forward, backend="aot_eager")
    x = torch.randn(2, 8, C, generator=torch.Generator().manual_seed(3))
    layer(x).square().sum().backward()
    compiled(x).square().sum().backward()
    for (name, p), q in zip(layer.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=0, msg=name)
