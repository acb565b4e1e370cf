"""Context parallel (brigade/parallel/context.py): the cut of a sequence, the global positions and
the loss's share, the refusals, and attention by all-to-all over two processes equal to SDPA on
the whole sequence.

One 2-process gloo world (cp 2) answers the multi-process cases; `brigade check --cp`
(tests/check/test_context.py) and the trainer's equivalence (tests/train/test_trainer.py) prove
the whole under every schedule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from brigade.errors import BrigadeError
from brigade.launcher import agent, groups
from brigade.models.gpt import GPTConfig, gpt
from brigade.parallel import context
from brigade.world.degrees import Degrees
from brigade.world.mesh import World


def _parts(rank: int, size: int = 2, method: str = "all-to-all") -> context.ContextParallel:
    """A ContextParallel at `rank` of `size` without a process group (the cut and the shares)."""
    cp = context.ContextParallel.__new__(context.ContextParallel)
    cp.group, cp.mesh, cp.method, cp.size, cp.rank = None, None, method, size, rank
    cp.calls, cp.verified = 0, False
    return cp


def test_all_to_all_cuts_consecutive_parts_and_ring_a_head_and_a_tail_chunk():
    x = torch.arange(16).view(2, 8)
    assert [_parts(r).cut(x)[0].tolist() for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    ring = [_parts(r, 2, "ring").cut(x)[0].tolist() for r in range(2)]
    assert ring == [[0, 1, 6, 7], [2, 3, 4, 5]]  # chunks 0 and 3, 1 and 2: as much causal work each
    assert _parts(1, 4, "ring").index(16).tolist() == [2, 3, 12, 13]
    assert _parts(1).cut(torch.ones(3)).shape == (3,)  # no sequence dimension: whole


def test_every_part_counts_by_its_share_of_the_counted_targets():
    y = torch.tensor([[1, 2, -100, -100], [3, 4, 5, -100]])  # counted: 2 + 3 in part 0, 0 + 1 in part 1
    shares = [_parts(r).share(y) for r in range(2)]
    assert shares == [2 * 4 / 5, 2 * 1 / 5]
    assert sum(shares) / 2 == 1.0  # the parts' mean of share × part-mean = the whole's token mean
    assert _parts(0).share(torch.ones(2, 4)) == 1.0  # float targets: every one counts


def test_the_method_and_the_layout_are_refused_in_one_line_where_they_cannot_run():
    assert context.method_for("auto", "cpu") == "all-to-all" and context.method_for("auto", "cuda") == "ring"
    with pytest.raises(BrigadeError, match=r"^--cp-method ring on cpu: torch's ring attention runs on "
                                           r"CUDA only .*use --cp-method all-to-all$"):
        context.method_for("ring", "cpu")
    with pytest.raises(BrigadeError, match="--cp-method 'spiral': expected one of auto, all-to-all, ring"):
        context.check_layout(2, "spiral")
    with pytest.raises(BrigadeError, match="--cp 2 with --ep 2: context parallel does not compose"):
        context.check_layout(2, "auto", ep=2)
    with pytest.raises(BrigadeError, match="--cp 2 with --local-stages 2"):
        context.check_layout(2, "auto", local_stages=2)
    with pytest.raises(BrigadeError, match="--cp 2 with --runtime local"):
        context.check_layout(2, "auto", runtime="local")


def test_a_length_or_heads_that_do_not_split_are_refused_naming_what_would():
    with pytest.raises(BrigadeError, match=r"--block-size 30 does not split into --cp 4 = 4 equal parts: "
                                           r"use a sequence length that 4 divides, like 32"):
        context.check_length(30, 4)
    with pytest.raises(BrigadeError, match=r"into --cp 2 × 2 chunks \(ring\) × --tp 2 = 8 equal parts"):
        context.check_length(36, 2, 2, "ring")
    context.check_length(36, 2, 2)
    with pytest.raises(BrigadeError, match=r"the model has 6 attention heads, which --cp 4 = 4 does not "):
        context.check_heads(6, 6, 4)
    blocks = gpt(GPTConfig(n_head=6, n_embd=48))
    assert context.heads_of(blocks) == 6 and context.heads_of([torch.nn.Linear(2, 2)]) is None
    with pytest.raises(BrigadeError, match=r"^gpt has 6 attention heads, which --cp 2 × --tp 2 = 4"):
        context.check_model(blocks, 2, "all-to-all", 2, 128, "gpt")
    context.check_model(blocks, 2, "ring", 2, 128, "gpt")  # ring splits the sequence, not the heads


def test_a_sliding_window_shorter_than_the_sequence_is_refused():
    block = torch.nn.Linear(2, 2)
    block.window = 64
    with pytest.raises(BrigadeError, match=r"sliding window of 64 positions, shorter than the sequence "
                                           r"\(128\) under --cp 2"):
        context.check_model([block], 2, "all-to-all", 1, 128, "hf:mistral")
    context.check_model([block], 2, "all-to-all", 1, 64, "hf:mistral")


def test_blocks_that_take_positions_are_found_by_their_forward():
    blocks = gpt(GPTConfig())
    assert [context.takes_positions(b) for b in blocks] == [True] + [False] * (len(blocks) - 1)


def _attention(q, k, v, cp, rank, **kw):
    """This rank's queries over every key, by all-to-all: (output, q/k/v gradients) of its part."""
    n = q.shape[2] // 2
    mine = [z[:, :, rank * n:(rank + 1) * n].detach().clone().requires_grad_() for z in (q, k, v)]
    out = cp.attend(*mine, **kw)
    out.square().sum().backward()
    return out, [z.grad for z in mine]


def worker() -> dict:
    """Rank r's half of each sequence through the all-to-all attention, against SDPA whole: causal,
    full, grouped-query with key/value heads that split and that do not; and a mask refused."""
    info = groups.init(threads=1)
    world = World(Degrees(cp=2), info.device)
    cp = context.ContextParallel(world.group("cp"), world.cp_mesh, "all-to-all")
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, kv_heads, kw in (("causal", 4, {"is_causal": True}), ("full", 4, {}),
                               ("gqa", 2, {"is_causal": True, "enable_gqa": True}),
                               ("gqa-repeated", 1, {"is_causal": True, "enable_gqa": True})):
        q = torch.randn(2, 4, 8, 6, generator=g, requires_grad=True)
        k, v = (torch.randn(2, kv_heads, 8, 6, generator=g, requires_grad=True) for _ in range(2))
        whole = F.scaled_dot_product_attention(q, k, v, **kw)
        whole.square().sum().backward()
        got, grads = _attention(q, k, v, cp, world.rank, **kw)
        r, n = world.rank, 4
        out[name] = max([(got - whole[:, :, r * n:(r + 1) * n]).abs().max().item()] +
                        [(a - z.grad[:, :, r * n:(r + 1) * n]).abs().max().item()
                         for a, z in zip(grads, (q, k, v))])
    mode = context._Attention(cp, "block 1 (Block)")
    try:
        with mode:
            F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    except BrigadeError as exc:
        out["mask"] = str(exc)
    groups.destroy()
    return out


@pytest.fixture(scope="module")
def launched() -> dict:
    return agent.launch(worker, 2)


@pytest.mark.timeout(120)
def test_attention_by_all_to_all_equals_sdpa_on_the_whole_sequence(launched):
    """Output and every q/k/v gradient of each part equal the whole sequence's: causal and full
    attention, grouped-query with key/value heads the all-to-all splits and with one it repeats."""
    for rank, got in launched.items():
        for case in ("causal", "full", "gqa", "gqa-repeated"):
            assert got[case] < 1e-5, (rank, case, got[case])


@pytest.mark.timeout(120)
def test_a_mask_built_on_one_part_is_refused_in_one_line(launched):
    for got in launched.values():
        assert got["mask"].startswith("block 1 (Block) calls attention with a mask under --cp 2: a mask "
                                      "built on one part cannot say what the whole sequence's is")


def test_a_wrong_all_to_all_would_be_caught(monkeypatch):
    """The check above can fail: with an all-to-all that leaves every part where it is (each
    process attending only to its own part), the second part's output differs from the whole's."""
    monkeypatch.setattr(context, "_all_to_all", lambda x, group: x)
    q = torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(0))
    cp = _parts(1)
    n = 4
    got = cp.attend(q[:, :, n:], q[:, :, n:], q[:, :, n:], is_causal=True)
    whole = F.scaled_dot_product_attention(q, q, q, is_causal=True)[:, :, n:]
    assert got.shape == whole.shape and (got - whole).abs().max() > 1e-3
