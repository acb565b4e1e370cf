"""Shared weights: found, untied into copies, gradients summed so the copies stay one parameter."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from brigade.errors import BrigadeError
from brigade.launcher import agent, groups
from brigade.pipeline.stages import boundary
from brigade.pipeline.stages import ties as stage_ties

PLACEMENT = {0: 0, 1: 0, 2: 1}  # blocks 0 and 1 on rank 0 (two copies there), block 2 on rank 1


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(5, 3)

    def forward(self, idx):  # (B, T) -> (B, T, 3)
        return self.tok(idx)


class Mix(nn.Module):
    """Uses the embedding table too, through a reference to its module."""

    def __init__(self, embed: Embed):
        super().__init__()
        self.table = embed.tok
        self.lin = nn.Linear(3, 3)

    def forward(self, h):  # (B, T, 3) -> (B, T, 3)
        w = self.table.weight
        return self.lin(h) + h @ (w.T @ w) / 5


class Head(nn.Module):
    def __init__(self, embed: Embed):
        super().__init__()
        self.out = nn.Linear(3, 5, bias=False)
        self.out.weight = embed.tok.weight  # tied

    def forward(self, h):  # (B, T, 3) -> (B, T, 5)
        return self.out(h)


def model(seed=0):
    torch.manual_seed(seed)
    embed = Embed()
    return [embed, Mix(embed), Head(embed)]


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(5, (4, 6), generator=g), torch.randint(5, (4, 6), generator=g)


def loss_fn(logits, y):
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def reference():
    """One process, the tie intact: autograd sums the three uses."""
    blocks = model()
    x, y = data()
    h = x
    for b in blocks:
        h = b(h)
    loss_fn(h, y).backward()
    return {n: p.grad.clone() for n, p in nn.ModuleList(blocks).named_parameters()}


def test_find_shared_names_every_use():
    blocks = model()
    (tie,) = stage_ties.find_shared(blocks)
    assert tie.name == "blocks.0.tok.weight"
    assert tie.uses == ((0, "tok.weight"), (1, "table.weight"), (2, "out.weight"))
    assert tie.blocks == (0, 1, 2)
    assert stage_ties.aliases([tie]) == {"blocks.1.table.weight": tie.name, "blocks.2.out.weight": tie.name}
    assert stage_ties.find_shared([nn.Linear(2, 2), nn.Linear(2, 2)]) == []


def test_untie_gives_each_later_block_its_own_equal_copy():
    blocks = model()
    ties = stage_ties.untie(blocks)
    params = [stage_ties.parameter(blocks[i], path) for i, path in ties[0].uses]
    assert len({id(p) for p in params}) == 3
    assert all(torch.equal(p, params[0]) for p in params)
    assert blocks[1].table is not blocks[0].tok  # the shared module was copied, not changed
    assert blocks[0].tok.weight is params[0]
    assert stage_ties.find_shared(blocks) == []


def test_the_same_block_twice_is_refused():
    layer = nn.Linear(2, 2)
    with pytest.raises(BrigadeError, match="blocks 0 and 1 are the same module object"):
        stage_ties.untie([layer, layer])


def test_stage_ties_untie_only_across_stages_and_group_each_pipeline_line(monkeypatch):
    """Blocks 0, 1 on stage 0 (rank 0), block 2 on stage 1 (rank 1), two pipeline lines (dp 2): the
    tie crosses stages, so every block but the first gets its own copy (copies in one process are
    summed there); one placement per line, each block on its stage's rank of that line. A tie
    inside one stage is left as it is."""
    made = []
    monkeypatch.setattr(stage_ties, "TieGroups", lambda ties, placements: made.append(placements) or "groups")
    blocks = model()
    st = stage_ties.StageTies(blocks, [2, 1], [0, 1], lines=[[0, 1], [2, 3]])
    assert [t.blocks for t in st.ties] == [(0, 1, 2)]
    assert blocks[2].out.weight is not blocks[0].tok.weight and blocks[1].table is not blocks[0].tok
    assert st.aliases == {"blocks.1.table.weight": "blocks.0.tok.weight",
                          "blocks.2.out.weight": "blocks.0.tok.weight"}
    assert made == [[{0: 0, 1: 0, 2: 1}, {0: 2, 1: 2, 2: 3}]] and st.groups == "groups"
    local = stage_ties.StageTies(model(), [2, 1], [0, 1], lines=None)  # every stage in this process
    assert local.groups is None and len(made) == 1
    one = model()
    inside = stage_ties.StageTies(one, [3], [0], lines=[[0], [1]])  # one stage: autograd sums the uses
    assert inside.ties == [] and one[2].out.weight is one[0].tok.weight and len(made) == 1


def test_copies_in_one_process_are_summed_locally():
    ref = reference()
    blocks = model()
    ties = stage_ties.untie(blocks)
    x, y = data()
    h = x
    for b in blocks:
        h = b(h)
    loss_fn(h, y).backward()
    stage_ties.sum_tied_grads(ties, dict(enumerate(blocks)))
    for i, path in ties[0].uses:
        torch.testing.assert_close(stage_ties.parameter(blocks[i], path).grad, ref["0.tok.weight"])
    torch.testing.assert_close(blocks[1].lin.weight.grad, ref["1.lin.weight"])


def tied_worker():
    """Rank 0 runs blocks 0-1, rank 1 block 2; the activation and its gradient travel by send/recv."""
    groups.init(threads=1)
    rank = dist.get_rank()
    blocks = model()
    ties = stage_ties.untie(blocks)
    tie_groups = stage_ties.TieGroups(ties, [PLACEMENT])
    held = {i: b for i, b in enumerate(blocks) if PLACEMENT[i] == rank}
    x, y = data()
    if rank == 0:
        h = blocks[1](blocks[0](x))
        dist.send(h.detach(), 1)
        grad = torch.empty_like(h)
        dist.recv(grad, 1)
        h.backward(grad)
    else:
        h = torch.empty(4, 6, 3)
        dist.recv(h, 0)
        h.requires_grad_(True)
        loss_fn(blocks[2](h), y).backward()
        dist.send(h.grad, 0)
    before = {i: stage_ties.parameter(held[i], p).grad.clone() for i, p in ties[0].uses if i in held}
    stage_ties.sum_tied_grads(ties, held, tie_groups)
    after = {i: stage_ties.parameter(held[i], p).grad.clone() for i, p in ties[0].uses if i in held}
    groups.destroy()
    return before, after


@pytest.mark.timeout(180)
def test_copies_on_two_processes_get_the_summed_gradient():
    results = agent.launch(tied_worker, 2)
    ref = reference()["0.tok.weight"]
    before = {**results[0][0], **results[1][0]}
    assert sorted(before) == [0, 1, 2]
    total = before[0] + before[1] + before[2]
    torch.testing.assert_close(total, ref)  # each copy got its own use's part
    for rank in (0, 1):
        for grad in results[rank][1].values():
            torch.testing.assert_close(grad, ref)  # every copy now holds the sum


def test_a_placement_without_a_tied_block_is_refused():
    ties = stage_ties.find_shared(model())
    with pytest.raises(BrigadeError, match="has no rank for block 2, which uses the shared parameter "
                                           "blocks.0.tok.weight"):
        _tie_groups_alone(ties, [{0: 0, 1: 0}])


def _tie_groups_alone(ties, placements):
    """TieGroups in a group of one process (it needs the default group for its rank)."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        return stage_ties.TieGroups(ties, placements)
    finally:
        dist.destroy_process_group()


def test_optimizer_steps_keep_copies_equal():
    blocks = model()
    ties = stage_ties.untie(blocks)
    ref_blocks = model()
    opt = torch.optim.AdamW([p for b in blocks for p in b.parameters()], lr=0.1)
    ref_opt = torch.optim.AdamW(nn.ModuleList(ref_blocks).parameters(), lr=0.1)
    x, y = data()
    for _ in range(3):
        for bs, o in ((blocks, opt), (ref_blocks, ref_opt)):
            o.zero_grad()
            h = x
            for b in bs:
                h = b(h)
            loss_fn(h, y).backward()
        stage_ties.sum_tied_grads(ties, dict(enumerate(blocks)))
        opt.step()
        ref_opt.step()
    for i, path in ties[0].uses:
        torch.testing.assert_close(stage_ties.parameter(blocks[i], path), ref_blocks[0].tok.weight)


def tiny_gpt(tie=True):
    from brigade.models.gpt import GPTConfig, gpt

    torch.manual_seed(0)
    return gpt(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16, tie_embeddings=tie))


def test_the_tied_gpt_shares_one_parameter_and_is_the_default():
    from brigade.models.gpt import GPTConfig

    assert GPTConfig().tie_embeddings is True
    tied, untied = tiny_gpt(), tiny_gpt(tie=False)
    (tie,) = stage_ties.find_shared(tied)
    assert tie.uses == ((0, "tok.weight"), (3, "out.weight")) and stage_ties.find_shared(untied) == []
    count = sum(p.numel() for p in nn.ModuleList(tied).parameters())
    assert count == sum(p.numel() for p in nn.ModuleList(untied).parameters()) - 11 * 16


def test_the_tied_gpt_split_in_two_stages_matches_one_device():
    """Two stages in one process, joined as a boundary joins them (structure helpers), with the
    tie untied: the loss, every gradient and one AdamW step equal the tied model's."""
    from brigade.models.gpt import gpt_loss
    from brigade.pipeline.stages.side_inputs import StageModule

    ref, blocks = tiny_gpt(), tiny_gpt()
    ties = stage_ties.untie(blocks)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(11, (4, 8), generator=g), torch.randint(11, (4, 8), generator=g)
    ref_loss = gpt_loss(StageModule(ref)(x), y)
    ref_loss.backward()
    first, last = StageModule(blocks[:2]), StageModule(blocks[2:], indices=[2, 3], stage=1)
    sent = first(x)
    received = boundary.as_inputs(sent)
    loss = gpt_loss(last(received), y)
    loss.backward()
    torch.autograd.backward(*boundary.backward_pairs(sent, boundary.input_grads(received)))
    stage_ties.sum_tied_grads(ties, dict(enumerate(blocks)))
    torch.testing.assert_close(loss, ref_loss)
    ref_grads = dict(nn.ModuleList(ref).named_parameters(remove_duplicate=False))
    for name, p in nn.ModuleList(blocks).named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, msg=name)
    for model_blocks in (ref, blocks):
        torch.optim.AdamW(nn.ModuleList(model_blocks).parameters(), lr=0.1).step()
    torch.testing.assert_close(blocks[3].out.weight, ref[0].tok.weight)
    torch.testing.assert_close(blocks[0].tok.weight, ref[0].tok.weight)
