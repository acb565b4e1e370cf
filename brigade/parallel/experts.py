"""Expert parallel: a mixture of experts' experts split over the processes of an expert group.

`--ep E` carves expert groups of E out of the data-parallel processes of a stage (`world.Degrees`,
the world's expert mesh: dp = edp × ep). Each MoE layer (`models.moe.MoE`) of a held block keeps
its router, its shared expert and everything dense as before, replicated or sharded over all of
dp; its stacked experts are split along the experts: a process of the group holds experts
[r·E/ep, (r+1)·E/ep), as DTensors Shard(0) over the expert mesh's "ep" (so snapshots and `brigade
check` see one weight, whatever the degree). Tokens go to their experts and back by two
all-to-alls over the group (`AllToAll`, the seam `moe.Dispatch` leaves):

    this process's rows, sorted by expert ─ counts exchanged (an all-to-all of E numbers)
      ─ rows to the processes of their experts (all-to-all, uneven) ─ regrouped by expert
      ─ the local experts' SwiGLUs ─ back in arrival order ─ all-to-all back ─ unsorted

Both row all-to-alls are differentiable (`all_to_all_single_autograd`): their backward is the
reverse all-to-all, in the backward's input pass (I), since the experts' outputs and the
layer's input both lie on the path from the loss to the block's input. Every process of a
group runs the same pipeline plan, so they reach each all-to-all in the same order; the
communication-order proof checks that this holds with the pipeline's sends and receives
(`pipeline.transport.nccl.check_experts`).

Gradients. A process's expert gradient is the sum, over every process of its group, of what its
tokens gave: Σ_{r in group} ∂L_r/∂w. The dense weights are the mean over dp, (1/dp) Σ_r ∂L_r/∂w,
so an expert's is its sum over the edp processes holding the same experts, divided by dp:

    sharded (FSDP2)   the experts one FSDP unit of their own over "edp" (`shard_experts`), whose
                      reduce-scatter leaves the mean over edp; `settle_grads` divides that by ep
                      (`reduce_grads`; FSDP2's own divide factor needs a reduction gloo lacks,
                      PREMUL_SUM); the dense weights' unit leaves them out
    replicated (DDP)  DDP ignores them (`ignored_names`); `settle_grads` all-reduces them over
                      "edp" and divides by dp (`reduce_grads`)

A process's gradient norm counts its experts once: their squares are summed over the expert
group (and over edp where they are sharded), not over the shard group (`norm_groups`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from brigade.errors import BrigadeError
from brigade.models.moe import MoE


def layers(modules) -> list[MoE]:
    """Every MoE layer inside `modules`, in module order."""
    return [m for module in modules for m in module.modules() if isinstance(m, MoE)]


def is_expert(p: torch.Tensor) -> bool:
    """Whether `p` (a parameter) is one of an expert group's split weights."""
    return getattr(p, "_brigade_expert", False)


def check_divides(blocks: list[nn.Module], ep: int) -> None:
    """Refuse an ep that does not divide some MoE layer's experts, in one line.

    Raises:
        BrigadeError: the first block whose experts ep does not divide.
    """
    for i, block in enumerate(blocks):
        for layer in layers([block]):
            if layer.cfg.experts % ep:
                raise BrigadeError(f"--ep {ep} does not divide the {layer.cfg.experts} experts of block {i}: "
                                   f"give --ep a divisor of {layer.cfg.experts} (each process of an expert "
                                   "group holds experts ÷ ep of them)")


def check_model(blocks: list[nn.Module], ep: int, model: str = "the model") -> None:
    """Refuse an ep > 1 over a model without a mixture of experts, or one whose experts it does
    not divide, in one line (before any process starts: train's and check's preflight).

    Raises:
        BrigadeError: as said.
    """
    if ep == 1:
        return
    if not layers(blocks):
        raise BrigadeError(f"--ep {ep} but {model} has no mixture-of-experts layer to split: give "
                           "--experts (gpt) or an MoE model, or drop --ep")
    check_divides(blocks, ep)


def split_experts(blocks: list[nn.Module], world) -> None:
    """Expert parallel on `blocks` (this process's held blocks), in place: each MoE layer's
    experts made DTensors Shard(0) over the world's expert mesh's "ep" (this process's slice of
    the weights it was built with, or of meta/empty ones an `hf:DIR` load fills in later), and
    its dispatch the group's all-to-all. Nothing where ep is 1."""
    from torch.distributed.tensor import DTensor, Shard

    ep = world.degrees.ep
    if ep == 1:
        return
    check_divides(blocks, ep)
    mesh, rank = world.expert_mesh["ep"], world.coords.ep
    for layer in layers(blocks):
        per = layer.cfg.experts // ep
        for name, w in list(layer.experts.named_parameters(recurse=False)):
            part = w.detach()[rank * per:(rank + 1) * per].clone()
            p = nn.Parameter(DTensor.from_local(part, mesh, [Shard(0)], run_check=False),
                             requires_grad=w.requires_grad)
            p._brigade_expert = True
            setattr(layer.experts, name, p)
        layer.dispatcher = AllToAll(world.group("ep"), ep)


def ignored_names(module: nn.Module) -> list[str]:
    """The names in `module` of its expert weights (what DDP must leave alone)."""
    return [name for name, p in module.named_parameters() if is_expert(p)]


def shard_experts(stage: nn.Module, world, reshard: bool, policy) -> None:
    """Each MoE layer's experts in `stage` one FSDP2 unit over the expert mesh's "edp" (module
    docstring), before the stage's own units take the rest: sharded along their second dimension
    (the first is split over "ep" already)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    for layer in layers([stage]):
        fully_shard(layer.experts, mesh=world.expert_mesh["edp"], reshard_after_forward=reshard,
                    mp_policy=policy, shard_placement_fn=lambda p: Shard(1))
        for p in layer.experts.parameters():
            p._brigade_expert = True


def reduce_grads(held: list[nn.Module], world, sharded: bool) -> None:
    """Every expert gradient of `held` made the mean over dp a dense weight's is (module
    docstring): sharded, FSDP2's mean over edp divided by ep; replicated, summed over "edp" and
    divided by dp."""
    grads = [p.grad for layer in layers(held) for p in layer.experts.parameters()
             if is_expert(p) and p.grad is not None]
    if not grads:
        return
    from brigade import forensics
    from brigade.dtensors import local

    parts = [local(g) for g in grads]
    if sharded:
        torch._foreach_div_(parts, float(world.degrees.ep))
        return
    flat = torch.cat([g.reshape(-1) for g in parts])
    if world.degrees.dp // world.degrees.ep > 1:
        forensics.doing("allreduce expert gradients over their replicas", waiting=True)
        dist.all_reduce(flat, group=world.group("edp"))
    flat.div_(world.degrees.dp)
    for g, part in zip(parts, flat.split([g.numel() for g in parts])):
        g.copy_(part.view_as(g))


def norm_group(world, sharded: bool):
    """The group over which the squares of a process's expert gradients add up to the whole
    model's experts: the expert group, and edp with it where they are sharded (all of dp)."""
    return world.group("dp") if sharded else world.group("ep")


def same_plan(actions: list, world) -> None:
    """Prove that every pipeline line this pipeline rank meets in collectives runs `actions` (its
    plan for a step): an expert group's all-to-alls, and context parallel's in every attention,
    pair only if their processes reach them in one order (`pipeline.transport.collectives`: lines
    that run different plans deadlock). One all-reduce over dp (dp × cp under --cp) of a
    fingerprint of the plan, where ep > 1 or cp > 1.

    Raises:
        RunError: the lines' plans differ (before any all-to-all could hang on it).
    """
    if world.degrees.ep == 1 and world.degrees.cp == 1:
        return
    import zlib

    from brigade.errors import RunError

    mark = zlib.crc32(" ".join(map(str, actions)).encode())
    both = torch.tensor([mark, -mark], dtype=torch.int64, device=world.device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=world.group("dpcp"))
    if both.tolist() != [mark, -mark]:
        flag = "--ep" if world.degrees.ep > 1 else "--cp"
        raise RunError(f"pipeline rank {world.coords.pp}'s plan differs between data-parallel replicas "
                       f"(dp {world.coords.dp}'s is {len(actions)} actions, {mark:08x}): under {flag} their "
                       "all-to-alls would pair in different orders and hang; plan on costs every process "
                       "agrees on")


class AllToAll:
    """The expert group's dispatch and combine (module docstring): rows to the processes holding
    their experts, and the outputs back, by all-to-alls over `group` of `ep` processes."""

    def __init__(self, group, ep: int):
        self.group, self.ep = group, ep

    def dispatch(self, rows: torch.Tensor, expert: torch.Tensor, experts: int):
        """(the rows this process's experts take from every process of the group, grouped by
        expert; how many each of its experts takes; what `combine` needs)."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=experts)
        per = experts // self.ep
        got = torch.empty_like(counts)  # [source][local expert]: what each process sends here
        dist.all_to_all_single(got, counts, group=self.group)
        sent = counts.view(self.ep, per).sum(1).tolist()
        table = got.view(self.ep, per)
        came = table.sum(1).tolist()
        arrived = wait_tensor(all_to_all_single_autograd(rows[order], came, sent, self.group))
        regroup = _expert_major(table)
        return arrived[regroup], table.sum(0), (order, regroup, sent, came)

    def combine(self, out: torch.Tensor, undo) -> torch.Tensor:
        """The local experts' outputs `out` back to the processes their rows came from, in the
        order of the rows dispatched there."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

        order, regroup, sent, came = undo
        back = torch.empty_like(out).index_copy(0, regroup, out)  # in arrival order again
        home = wait_tensor(all_to_all_single_autograd(back, sent, came, self.group))
        return torch.empty_like(home).index_copy(0, order, home)


def _expert_major(table: torch.Tensor) -> torch.Tensor:
    """The row order that regroups rows arrived source by source (`table[s][e]` rows from source
    s for local expert e, sources outermost) expert by expert, sources in order within each."""
    sizes = table.reshape(-1)
    starts = torch.cumsum(sizes, 0) - sizes  # where each (source, expert) run begins
    runs = sizes.view(table.shape).t().reshape(-1)  # the runs expert-major
    first = starts.view(table.shape).t().reshape(-1)
    offsets = torch.arange(int(runs.sum()), device=table.device) - \
        torch.repeat_interleave(torch.cumsum(runs, 0) - runs, runs)
    return torch.repeat_interleave(first, runs) + offsets
