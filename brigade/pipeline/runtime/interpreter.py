"""The interpreter: runs one rank's list of actions for one step, over the stages it holds.

`StageRunner.run` walks the actions in order and hands each to the handler of
its kind (`handlers.HANDLERS`, keyed by `Op`, as torch's `_perform_action` does); it never decides the
order itself, so every schedule runs through this one loop. A rank may hold
several stages (interleaved, looped BFS, ZB-V); each action runs on its stage's
module. It talks to other ranks only through a transport (`send`, `recv`,
`flush`), so the same code serves processes and device threads; between two
stages of the same rank (the turn of a V) the output is handed over by reference,
detached so that each stage's backward stays its own action. An output may be a
structure (`structure.flatten`): the next stage takes it `boundary.as_inputs`, and sends
back `input_grads` (None for integer tensors); `backward_pairs` feeds autograd.

    F on stage s ──► y ──┬─ stage s+1 on another rank: SEND_F (a message)
                         └─ stage s+1 here: acts[(s+1, mb)] = detached y  (no copy)

Loss convention: on the last stage each micro-batch's mean loss is multiplied
by its share of the batch (`microbatch.weights`) before backward, so the
gradients add up to those of the mean loss over the whole batch.

Data parallel: a stage wrapped in DistributedDataParallel has its gradients averaged once
per step. With one stage per rank and a plain backward, DDP's own reducer does it during
the last backward. Otherwise (a split I/W backward, or several stages per rank) the stage's
`GradientReducer` starts the all-reduce as soon as that stage's last backward or weight
pass is done, so it overlaps the actions that remain, and waits at the end of the step.
A stage under FSDP2 (`fully_shard`) reduce-scatters once, at the end of every step that syncs
(`ShardedReducer`), whatever the schedule; its backwards see the gathered parameters. Without a
pipeline (one stage, a whole backward) FSDP reduces each block's gradients as its backward
ends, every micro-batch, as it does on its own.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from brigade import forensics
from brigade.pipeline.plans.action import COMM_OPS, RECV_B, RECV_F, Action, W
from brigade.pipeline.runtime.handlers import HANDLERS
from brigade.pipeline.runtime.reduce import GradientReducer, ShardedReducer
from brigade.pipeline.runtime.step import Step, StepResult
from brigade.pipeline.transport.local import Transport
from brigade.pipeline.transport.ordering import peer_of

__all__ = ["StageRunner", "StepResult"]


class StageRunner:
    """Runs one rank's actions over the stages it holds.

    Args:
        modules: stage index -> that stage's blocks (possibly wrapped in DistributedDataParallel).
        n_stages: stages in the whole pipeline (ranks × stages per rank).
        transport: a `Transport` (P2P between processes, or a local endpoint).
        loss_fn: (output, target) -> mean loss; used on the last stage only.
        autocast: None (fp32), torch.bfloat16 or torch.float16 for the forwards.
        draws: `draws(stage, microbatch, module)`, the context each forward runs in: where
            device threads share a generator, `randomness.StageRandom.forward` (default: none).
    """

    def __init__(self, modules: dict[int, nn.Module], n_stages: int, transport: Transport, loss_fn=None,
                 autocast: torch.dtype | None = None, draws: Callable | None = None):
        self.modules = dict(sorted(modules.items()))
        self.n_stages = n_stages
        self.transport = transport
        self.loss_fn = loss_fn
        self.is_first = 0 in self.modules
        self.is_last = n_stages - 1 in self.modules
        self.autocast = autocast  # e.g. torch.bfloat16 on GPUs
        self.draws = draws or (lambda stage, microbatch, module: contextlib.nullcontext())
        several = len(self.modules) > 1
        # Under DDP: a reducer per stage for split backwards (DDP's reducer does not see them),
        # and for every backward when this rank holds several stages (see the module docstring).
        self.reducers = {s: GradientReducer(_reduced(m), m.process_group, m.bucket_bytes_cap)
                         for s, m in self.modules.items() if isinstance(m, DistributedDataParallel)}
        self.ddp_reduces = not several  # DDP's own reducer, on plain backwards
        # Under FSDP2: its reduction held off for the step, run once at its end, except without a
        # pipeline, where FSDP reduces each block as its backward ends (reduce.py).
        self.sharded = {s: ShardedReducer(m, whole=n_stages == 1) for s, m in self.modules.items()
                        if _is_sharded(m)}
        self._param_lists = {s: list((m.module if isinstance(m, DistributedDataParallel) else m).parameters())
                             for s, m in self.modules.items()}  # listed once, asked for every backward

    @property
    def stage(self) -> int:
        """This rank's first stage (the only one with one stage per rank)."""
        return next(iter(self.modules))

    def run(
        self,
        actions: list[Action],
        inputs: list | None = None,
        targets: list | None = None,
        weights: list[float] | None = None,
        keep_outputs: bool = False,
        trace: bool = False,
        sync: bool = True,
        side: list[dict] | None = None,
    ) -> StepResult:
        """Execute `actions` (with comms inserted) for one step.

        Args:
            inputs: the micro-batches, tensors or structures (rank of the first stage only).
            targets: the micro-batch targets (rank of the last stage; omit for pure inference).
            weights: each micro-batch's share of the batch (last stage, with targets).
            keep_outputs: keep the last stage's outputs (inference).
            trace: record (action, start, end) in perf_counter seconds.
            sync: under DistributedDataParallel, all-reduce gradients in this step; False
                while accumulating gradients over several steps.
            side: per micro-batch, the side inputs of the `StageModule`s this rank holds
                ({name: value}); a StageModule is called as module(x, side[mb]).

        Raises:
            PlanError: an action needs what no earlier action made (a B before its F, ...).
        """
        st = Step(actions, inputs, targets, weights, keep_outputs, sync, side)
        split = any(a.op == W for a in actions)
        if sync and (split or not self.ddp_reduces):
            st.reducers = dict(self.reducers)
        for sharded in self.sharded.values():
            sharded.begin(split)
        if sync and st.training:  # (without a pipeline FSDP reduces each backward itself)
            st.reducers.update({s: r for s, r in self.sharded.items() if not r.native})
        for reducer in st.reducers.values():
            reducer.reset()
        self.transport.begin_step(actions, (inputs, side) if self.is_first and side else
                                  inputs if self.is_first else None)
        with contextlib.nullcontext() if st.training else torch.no_grad():
            for a in actions:
                self._record(a)
                start = time.perf_counter() if trace else 0.0
                HANDLERS[a.op](self, a, st)
                if trace:
                    st.result.trace.append((a, start, time.perf_counter()))
            forensics.doing(f"flush sends (stages {list(self.modules)})", waiting=True)
            self.transport.flush()
        for reducer in st.reducers.values():
            reducer.finish()  # before anyone reads .grad (norm, clipping, optimizer)
        if not st.training:
            for reducer in self.sharded.values():
                reducer.rest()  # evaluation gathered parameters that no backward will reshard
        st.result.loss = st.total
        return st.result

    def params(self, s: int) -> list[torch.Tensor]:
        """Stage s's parameters as autograd sees them: inside DDP's wrapper (listed once), or
        under FSDP2 the gathered ones (asked for each time: FSDP makes them at the first forward)."""
        if s in self.sharded:
            return self.sharded[s].params()
        return self._param_lists[s]

    def _record(self, a: Action) -> None:
        """Tell the hang watchdog what this rank does now, naming the peer a transfer waits on."""
        if a.op not in COMM_OPS:
            forensics.doing(f"{a.op} mb{a.microbatch} (stage {a.stage})")
            return
        peer = peer_of(a)
        ranks = self.transport.peers
        rank = ranks[peer] if ranks else None
        where = f"{'from' if a.op in (RECV_F, RECV_B) else 'to'} stage {peer}"
        forensics.doing(f"{a.op} mb{a.microbatch} {where}" + (f" (rank {rank})" if ranks else ""),
                        waiting=True, on=rank)


def _reduced(ddp: DistributedDataParallel) -> list[torch.Tensor]:
    """The parameters DDP reduces: not those it was told to leave alone (`parameters_to_ignore`)."""
    return [p for name, p in ddp.module.named_parameters() if name not in ddp.parameters_to_ignore]


def _is_sharded(module: nn.Module) -> bool:
    """Whether `module` is a stage under FSDP2's `fully_shard` (an FSDPModule)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2 cannot have made one
        return False
    return isinstance(module, FSDPModule)
