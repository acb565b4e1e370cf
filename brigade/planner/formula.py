"""Per-block costs from a model's shapes alone, for a model this machine cannot run.

The model is built on PyTorch's meta device (shapes, no storage: a 70-billion-parameter model
costs nothing to build) and each block's forward and backward run there once, on a micro-batch
of meta tensors, under

    torch.utils.flop_counter   FLOPs of the forward and of the backward, per sample
    saved_tensors_hooks        bytes autograd keeps for the backward, per sample (parameters
                               and their views aside; a tensor saved twice counts twice, so the
                               figure errs high, where the measured one counts each storage once)
    forward hooks              the output bytes of every module that owns a parameter: what a
                               split backward keeps from I to W is the gradient at each weight's
                               output, the same shape (two that share a storage count twice)

and the times follow: FLOPs ÷ (the target's peak × `ASSUMED_MFU`), the backward split in equal
input- and weight-gradient halves (a matmul's two gradients cost the same FLOPs); AdamW's step
moves seven bytes per parameter byte (reads parameter, gradient and both moments, writes three)
at the target's memory bandwidth. Recompute `full` keeps only each block's input, runs the
forward again before the input-gradient pass and holds the whole forward's tensors again during
its backward (and, under a split backward, from I until W); `selective` is taken as `full`
(what it keeps depends on kernels a meta run does not choose). A block's temporaries are taken
as its output and that output's gradient. Every figure of a plan made from these says `formula`.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from brigade.models import ModelSpec
from brigade.pipeline.batches.feed import to
from brigade.planner.costs import FORMULA, ModeCosts, ModelCosts, master_bytes
from brigade.planner.devices import DeviceSpec
from brigade.planner.optimizer import foreach_transient
from brigade.planner.sample import runnable

ASSUMED_MFU = 0.5  # the share of peak a large model's blocks reach (Megatron-LM reports 40-55 %)
ADAMW_BYTES_MOVED = 7  # per parameter byte: read p, g, exp_avg, exp_avg_sq; write p and both moments


def from_shapes(spec: ModelSpec, size: int, modes: list[str], target: DeviceSpec,
                precision: str = "") -> ModelCosts:
    """Costs of `spec` (built on the meta device) on `target`, from a meta micro-batch of `size`."""
    x, y = (to(t, "meta") for t in spec.make_batch(size, torch.Generator().manual_seed(0)))
    rate = target.peak(precision) * ASSUMED_MFU
    times, held, kept, flops, outs = [], [], [], [], []
    x, blocks = runnable(spec.blocks, x)
    h = x
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        f, b, saved, at_weights, out = _run(block, h, spec.loss_fn if last else None, y, first=i == 0)
        times.append((f / rate, b / rate, b / 2 / rate, b / 2 / rate))  # (forward, backward, W, I)
        held.append(saved / size)
        kept.append(at_weights / size)
        flops.append((f + b) / size)
        outs.append(out.numel() * out.element_size() / size if torch.is_tensor(out) else 0.0)
        h = out.detach()
    inputs = [_bytes(x) / size, *outs[:-1]]  # what a recomputed block keeps: its input
    transient = [2 * o for o in outs]  # a block's output and its gradient, side by side
    # recomputed: the forward runs again before the input-gradient pass (once, under I and W too)
    again = [(f, b + f, w, i + f) for f, b, w, i in times]
    # recomputed: what the input pass made again stays with the weight outputs' gradients until W
    again_kept = [k + s for k, s in zip(kept, held)]
    per_mode = {m: ModeCosts({size: times}, held, [0.0] * len(held), transient, kept) if m == "none" else
                ModeCosts({size: again}, inputs, held, transient, again_kept) for m in modes}
    params = master_bytes(spec.blocks)
    costs = ModelCosts(spec.name, params, flops, outs, per_mode, ADAMW_BYTES_MOVED / target.mem_bw,
                       here=None, source=FORMULA, opt_transient=foreach_transient(params), opt_foreach=True)
    costs.notes.append(f"times from FLOPs at {ASSUMED_MFU:.0%} of {target.name}'s peak; memory from "
                       "the shapes of the tensors autograd saves")
    return costs


def _run(block, h, loss_fn, y, first: bool) -> tuple[float, float, float, float, torch.Tensor]:
    """(forward FLOPs, backward FLOPs, saved bytes, bytes at weights' outputs, output) of one
    meta forward and backward."""
    own = {id(p) for p in block.parameters()}
    saved, at_weights = [0], [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in own and id(getattr(t, "_base", None)) not in own:
            saved[0] += _bytes(t)
        return t

    def weighted(module, args, out) -> None:
        if torch.is_tensor(out) and out.requires_grad:
            at_weights[0] += _bytes(out)

    owners = [m for m in block.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
    hooks = [m.register_forward_hook(weighted) for m in owners]
    inp = h.detach().requires_grad_(h.is_floating_point() and not first)
    try:
        with FlopCounterMode(display=False) as forward:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = block(inp)
    finally:
        for hook in hooks:
            hook.remove()
    with FlopCounterMode(display=False) as backward:
        loss = loss_fn(out, y) if loss_fn is not None else out
        torch.autograd.backward(loss, None if loss_fn is not None else torch.ones_like(loss))
    return forward.get_total_flops(), backward.get_total_flops(), float(saved[0]), float(at_weights[0]), out


def _bytes(t: torch.Tensor) -> float:
    return float(t.numel() * t.element_size())
