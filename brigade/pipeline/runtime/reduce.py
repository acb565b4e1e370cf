"""Gradient reduction over data-parallel replicas where the wrapper's own cannot do it.

DDP hooks a normal backward. A split backward (I now, W later) never runs one, and a rank
holding several stages runs several backwards per micro-batch; in both cases the runner
(`interpreter.StageRunner`) hands each stage's finished parameters to a `GradientReducer`,
which all-reduces them in buckets as they complete and writes the mean into `.grad`.

FSDP2 (a stage under `fully_shard`) reduce-scatters after every backward of every
micro-batch, and never after a weight pass, which its hooks do not see. Without a pipeline
and with a whole backward that is what a `ShardedReducer` lets it do: each block's gradients
are reduced, and freed, as its backward ends. Under a pipeline it holds the reduction off for
the whole step (gradients accumulate in the gathered parameters) and runs FSDP's post-backward
by hand once at the end: one reduce-scatter per stage per step (torch's pipelining does the
same, `perform_reduce_grad`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
import torch.distributed as dist

from brigade import forensics


class Reducer(Protocol):
    """What the runner asks of a stage's gradient reduction during a step that syncs."""

    def reset(self) -> None:
        """A step begins: forget the last one's progress."""

    def ready(self, params: list[torch.Tensor]) -> None:
        """These parameters' gradients are complete for the step."""

    def finish(self) -> None:
        """The step's actions are done: leave the replicas' mean in `.grad`."""


class GradientReducer:
    """Averages a stage's gradients over data-parallel replicas after a split backward.

    Buckets hold parameters in reverse order (later layers finish first, as in DDP). During
    the step's last weight pass the runner reports finished parameters (`ready`); a bucket
    whose parameters are all finished starts an asynchronous all-reduce, always in bucket
    order so every replica issues the same collectives in the same order. `finish` starts
    what is left (parameters no pass reached), waits, and writes the mean into `.grad`.

        last W:  frontier node ─► ready(params) ─► bucket k complete ─► all_reduce(k, async)
        end:     finish() ─► launch the rest ─► wait each ─► ÷ replicas ─► .grad

    Args:
        params: the stage's parameters (those not requiring grad are skipped).
        group: the data-parallel process group.
        bucket_bytes: the most bytes a bucket holds (DDP's `bucket_bytes_cap`).
    """

    def __init__(self, params: Iterable[torch.Tensor], group, bucket_bytes: int = 25 * 2**20):
        self.group = group
        self.replicas = dist.get_world_size(group)
        self.buckets = _buckets([p for p in params if p.requires_grad][::-1], bucket_bytes)
        self._bucket_of = {id(p): k for k, b in enumerate(self.buckets) for p in b}
        self.reset()

    def reset(self) -> None:
        """Forget a step's progress (every bucket waits for all of its parameters again)."""
        self._pending = [{id(p) for p in b} for b in self.buckets]
        self._next = 0
        self._inflight: list[tuple[int, torch.Tensor, object]] = []

    def ready(self, params: list[torch.Tensor]) -> None:
        """These parameters' gradients are complete for this step; start every full bucket."""
        for p in params:
            k = self._bucket_of.get(id(p))
            if k is not None:
                self._pending[k].discard(id(p))
        while self._next < len(self.buckets) and not self._pending[self._next]:
            self._launch()

    def finish(self) -> None:
        """Reduce what is left, wait for every bucket, and put the replicas' mean in `.grad`."""
        while self._next < len(self.buckets):
            self._launch()
        for k, flat, work in self._inflight:
            forensics.doing(f"allreduce bucket {k}", waiting=True)
            work.wait()
            flat.div_(self.replicas)
            bucket = self.buckets[k]
            for p, g in zip(bucket, flat.split([p.numel() for p in bucket])):
                if p.grad is not None:  # None on every replica alike: the parameter was unused
                    p.grad.copy_(g.view_as(p))
        self.reset()

    def _launch(self) -> None:
        k, bucket = self._next, self.buckets[self._next]
        forensics.doing(f"allreduce bucket {k}", waiting=True)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in bucket])
        self._inflight.append((k, flat, dist.all_reduce(flat, group=self.group, async_op=True)))
        self._next += 1


def _buckets(params: list[torch.Tensor], cap: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of same device and dtype, each at most `cap` bytes (or one parameter)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        last = out[-1] if out else None
        if last is None or size + nbytes > cap or (p.device, p.dtype) != (last[0].device, last[0].dtype):
            out.append([])
            size = 0
        out[-1].append(p)
        size += nbytes
    return out


class ShardedReducer:
    """A stage's gradient reduction under FSDP2's `fully_shard` (and HSDP's all-reduce).

    Where the rank holds the whole model as one stage and the step's backward is whole (no
    pipeline, no I/W), FSDP runs its own way, as torchtitan runs it without a pipeline: each
    block's parameters are gathered for its forward and freed after it (`parallel.shard` reshards
    after forward there), gathered again for its backward, and its gradients reduce-scattered as
    that backward ends, into the sharded `.grad` where every micro-batch's add up. The rank then
    holds one or two blocks' gathered weights and unsharded gradients at a time, never the whole
    model's: `native`, and the runner leaves the step's reduction to FSDP.

    Otherwise (a pipeline stage, or a split backward) FSDP is told that no backward is the last
    one, so every backward (B, I or W, every micro-batch, every accumulation chunk) adds into the
    gathered parameters' `.grad`. `finish` then reduces each FSDP unit of the stage, FSDP's own
    way, leaving the mean of the replicas' gradients in the sharded parameters' `.grad` and the
    parameters sharded again: one reduce-scatter per stage per step, which a pipeline needs, as
    FSDP's hooks never see a weight pass and would otherwise reduce once per micro-batch.

    Under a pipeline, parameters stay gathered from a unit's backward to the step's end, except
    where the stage reshards after each forward (`parallel.shard`'s `reshard`) and the step's
    backward is whole: then after each backward too. A split backward's weight pass runs nodes of
    the input pass again, which read the gathered weights, so under I/W they stay.

    Uses FSDP's per-unit post-backward (`FSDPParamGroup.post_backward`), not a public API: the
    one torch's pipelining calls for the same reason.

    Args:
        module: the stage, an FSDPModule (its blocks may be FSDP units of their own).
        whole: the stage is the whole model, the only one its rank runs (no pipeline).
    """

    def __init__(self, module, whole: bool = False):
        self.module = module
        self.whole = whole
        self.units = self._units()  # made by fully_shard, fixed from then on: listed once
        self.reshard = any(g._reshard_after_forward for g in self.units)
        self.between = False  # reshard after each backward of this step
        self.native = False  # FSDP reduces each backward itself (above)
        self._hold()

    def begin(self, split: bool) -> None:
        """A step begins; `split`: its backward is I then W."""
        self.native = self.whole and not split
        self.between = self.reshard and not split
        if self.native:
            self._free()
        else:
            self._hold()

    def _free(self) -> None:
        self.module.set_requires_gradient_sync(True)
        self.module.set_is_last_backward(True)
        self.module.set_reshard_after_backward(True)

    def _hold(self) -> None:
        self.module.set_requires_gradient_sync(False)
        self.module.set_is_last_backward(False)
        self.module.set_reshard_after_backward(self.between)

    def _state(self):
        from torch.distributed.fsdp import fully_shard

        return fully_shard.state(self.module)

    def _units(self) -> list:
        """Every FSDP parameter group of the stage: each FSDP module's (made by fully_shard)."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        states = [fully_shard.state(m) for m in self.module.modules() if isinstance(m, FSDPModule)]
        return [g for st in states
                for g in getattr(st, "_fsdp_param_groups", None) or [st._fsdp_param_group] if g is not None]

    def params(self) -> list:
        """The gathered parameters autograd sees in this step's graphs (not the sharded ones)."""
        return [fp.unsharded_param for g in self.units for fp in g.fsdp_params
                if hasattr(fp, "_unsharded_param")]

    def reset(self) -> None:
        """Nothing to forget: FSDP keeps what the step has accumulated."""

    def ready(self, params: list) -> None:
        """Parameters finish as a whole stage here: `finish` reduces them all."""

    def finish(self) -> None:
        """Reduce-scatter every unit's accumulated gradients; reshard the parameters."""
        self.module.set_requires_gradient_sync(True)
        self.module.set_is_last_backward(True)
        self.module.set_reshard_after_backward(True)
        forensics.doing("reduce-scatter sharded gradients", waiting=True)
        for unit in self.units:
            unit.post_backward()
        self._state()._root_post_backward_final_callback()
        self._hold()

    def rest(self) -> None:
        """Free the gathered parameters (after a forward with no backward: evaluation)."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
