"""The interpreter: runs one rank's list of actions for one step, over the stages it holds.

`StageRunner.run` walks the actions in order and hands each to the handler of
its kind (`_HANDLERS`, as torch's `_perform_action` does); it never decides the
order itself, so every schedule runs through this one loop. A rank may hold
several stages (interleaved, looped BFS, ZB-V); each action runs on its stage's
module. It talks to other ranks only through a transport (`send`, `recv`,
`flush`), so the same code serves processes and device threads; between two
stages of the same rank (the turn of a V) the output is handed over by reference,
detached so that each stage's backward stays its own action. An output may be a
structure (`structure.flatten`): the next stage takes it `as_inputs`, and sends
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
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from brigade import forensics
from brigade.pipeline import structure
from brigade.pipeline.backward import GradientReducer, backward_split
from brigade.pipeline.ordering import peer_of
from brigade.pipeline.schedule import COMM_OPS, RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, I, PlanError, W
from brigade.pipeline.side import StageModule
from brigade.pipeline.transport import Transport


@dataclass
class StepResult:
    """What one rank got out of one step."""

    loss: torch.Tensor | None = None  # rank of the last stage: weighted sum of micro-batch losses
    outputs: list = field(default_factory=list)  # last stage, if asked (tensors or structures)
    trace: list[tuple[Action, float, float]] = field(default_factory=list)


Key = tuple[int, int]  # (stage, micro-batch)


@dataclass
class _Step:
    """One step's state, shared by the action handlers of `StageRunner`."""

    actions: list[Action]
    inputs: list | None
    targets: list | None
    weights: list[float] | None
    keep_outputs: bool
    sync: bool
    side: list[dict] | None = None  # per micro-batch: {side input name: value} for this rank's stages
    result: StepResult = field(default_factory=StepResult)
    held: dict[Key, tuple] = field(default_factory=dict)  # (stage input, output or loss), until B/W
    acts: dict[Key, torch.Tensor] = field(default_factory=dict)  # activations a forward will take
    grads: dict[Key, torch.Tensor] = field(default_factory=dict)  # gradients a backward will take
    outgoing: dict[Key, torch.Tensor] = field(default_factory=dict)  # input gradients to send
    weight_steps: dict[Key, Callable] = field(default_factory=dict)  # pending W of (stage, mb)
    total: torch.Tensor | None = None
    reducers: dict[int, GradientReducer] = field(default_factory=dict)  # stage -> its reducer
    remaining: dict[int, int] = field(default_factory=dict)  # stage -> backward/weight passes left

    def __post_init__(self) -> None:
        self.training = any(a.op in (B, I) for a in self.actions)
        for a in self.actions:
            if a.op == B or a.op == W:
                self.remaining[a.stage] = self.remaining.get(a.stage, 0) + 1

    def take(self, store: dict, a: Action, what: str, stage: int | None = None):
        """Remove and return (stage, micro-batch)'s entry, or name the action that lacks it."""
        key = (a.stage if stage is None else stage, a.microbatch)
        if key not in store:
            raise self.missing(a, what)
        return store.pop(key)

    def finished(self, stage: int) -> bool:
        """Count one backward or weight pass of `stage`; True for its last of the step."""
        self.remaining[stage] -= 1
        return self.remaining[stage] == 0

    @staticmethod
    def missing(a: Action, what: str) -> PlanError:
        return PlanError(f"{a}: no {what} for micro-batch {a.microbatch} on stage {a.stage} at this point: "
                         "the action list is out of order (check it with brigade.pipeline.plan.validate)")


_HANDLERS = {RECV_F: "_on_recv_forward", RECV_B: "_on_recv_backward", F: "_on_forward",
             SEND_F: "_on_send_forward", B: "_on_backward", I: "_on_input_grad", W: "_on_weight_grad",
             SEND_B: "_on_send_backward"}


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
        self.reducers = {s: GradientReducer(m.module.parameters(), m.process_group, m.bucket_bytes_cap)
                         for s, m in self.modules.items() if isinstance(m, DistributedDataParallel)}
        self.ddp_reduces = not several  # DDP's own reducer, on plain backwards
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
        st = _Step(actions, inputs, targets, weights, keep_outputs, sync, side)
        split = any(a.op == W for a in actions)
        if sync and (split or not self.ddp_reduces):
            st.reducers = self.reducers
        for reducer in st.reducers.values():
            reducer.reset()
        self.transport.begin_step(actions, (inputs, side) if self.is_first and side else
                                  inputs if self.is_first else None)
        with contextlib.nullcontext() if st.training else torch.no_grad():
            for a in actions:
                self._record(a)
                start = time.perf_counter() if trace else 0.0
                getattr(self, _HANDLERS[a.op])(a, st)
                if trace:
                    st.result.trace.append((a, start, time.perf_counter()))
            forensics.doing(f"flush sends (stages {list(self.modules)})", waiting=True)
            self.transport.flush()
        for reducer in st.reducers.values():
            reducer.finish()  # before anyone reads .grad (norm, clipping, optimizer)
        st.result.loss = st.total
        return st.result

    # --- one handler per action kind (`_HANDLERS`); each reads and updates the step's state ---

    def _on_recv_forward(self, a: Action, st: _Step) -> None:
        st.acts[(a.stage, a.microbatch)] = self.transport.recv(a)

    def _on_recv_backward(self, a: Action, st: _Step) -> None:
        st.grads[(a.stage, a.microbatch)] = self.transport.recv(a)

    def _on_forward(self, a: Action, st: _Step) -> None:
        s, i = a.stage, a.microbatch
        x = st.inputs[i] if s == 0 else st.take(st.acts, a, "received activation")
        if st.training and s > 0:
            x = structure.as_inputs(x)  # floating leaves require a gradient, integer ones pass
        with self.draws(s, i, self.modules[s]):  # the loss too: a loss may draw
            y = self._forward(s, x, st.side[i] if st.side else None)
            last = s == self.n_stages - 1
            if last and st.keep_outputs:
                st.result.outputs.append(_detach(y))
            if last and st.targets is not None:
                y = self._loss(y, st.targets[i], st.weights[i] if st.weights else 1.0)
                st.total = y.detach() if st.total is None else st.total + y.detach()
        if not last and s + 1 in self.modules:
            st.acts[(s + 1, i)] = _detach(y)  # the next stage is here: a reference, no message
        if st.training or (not last and s + 1 not in self.modules):
            st.held[(s, i)] = (x, y)

    def _on_send_forward(self, a: Action, st: _Step) -> None:
        key = (a.stage, a.microbatch)
        held = st.held.get(key) if st.training else st.held.pop(key, None)
        if held is None:
            raise st.missing(a, "forward output")
        self.transport.send(a, held[1])

    def _on_backward(self, a: Action, st: _Step) -> None:
        s = a.stage
        x, y = st.take(st.held, a, "forward output")
        grad = None if s == self.n_stages - 1 else st.take(st.grads, a, "received gradient")
        last = st.finished(s) and st.sync
        self._backward(s, y, grad, ddp_last=last and s not in st.reducers)
        if last and s in st.reducers:
            st.reducers[s].ready(self._params(s))  # starts now, overlaps what remains
        if s > 0:
            self._pass_back(a, structure.input_grads(x), st)

    def _on_input_grad(self, a: Action, st: _Step) -> None:
        s = a.stage
        if (s, a.microbatch) not in st.held:
            raise st.missing(a, "forward output")
        x, y = st.held[(s, a.microbatch)]  # kept until W
        grad = None if s == self.n_stages - 1 else st.take(st.grads, a, "received gradient")
        ys, grads = _pairs(y, grad, s == self.n_stages - 1)
        leaves, spec = structure.flatten(x, root="input") if s > 0 else ([], None)
        dxs, st.weight_steps[(s, a.microbatch)] = backward_split(ys, grads, leaves, self._params(s))
        if s > 0:  # integer leaves (and floating ones nothing depends on) get None
            self._pass_back(a, structure.unflatten(dxs, spec), st)

    def _on_weight_grad(self, a: Action, st: _Step) -> None:
        s = a.stage
        # Gradients are complete only in the stage's last weight pass of the step.
        last = st.finished(s) and s in st.reducers
        st.take(st.weight_steps, a, "input gradient (I)")(st.reducers[s].ready if last else None)
        st.held.pop((s, a.microbatch))

    def _on_send_backward(self, a: Action, st: _Step) -> None:
        self.transport.send(a, st.take(st.outgoing, a, "input gradient"))

    def _pass_back(self, a: Action, dx, st: _Step) -> None:
        """Hand stage s's input gradient to stage s-1: by reference if it is here, else to send."""
        if a.stage - 1 in self.modules:
            st.grads[(a.stage - 1, a.microbatch)] = dx
        else:
            st.outgoing[(a.stage, a.microbatch)] = dx

    def _params(self, s: int) -> list[torch.Tensor]:
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

    def _forward(self, s: int, x, side: dict | None):
        module = self.modules[s]
        inner = module.module if isinstance(module, DistributedDataParallel) else module
        args = (x, side) if isinstance(inner, StageModule) else (x,)
        amp = contextlib.nullcontext() if self.autocast is None else \
            torch.autocast(_device_type(x), dtype=self.autocast)
        with amp:
            if isinstance(module, DistributedDataParallel):
                # Gradients are reduced once per step (see _backward and the reducers).
                with module.no_sync():
                    return module(*args)
            return module(*args)

    def _loss(self, y, target: torch.Tensor, weight: float) -> torch.Tensor:
        """This micro-batch's weighted loss, in fp32 whatever the autocast dtype.

        The loss function runs outside autocast on the fp32 upcast of the output: a bf16
        cross-entropy is off by ~1e-2 at 4.6, and so would be the step's sum of such losses.
        """
        with torch.autocast(target.device.type, enabled=False):
            return _fp32(self.loss_fn(_fp32(y), target)) * weight  # (a float64 loss stays float64)

    def _backward(self, s: int, y, grad, ddp_last: bool) -> None:
        """Backward of stage s from its output structure `y` (or loss) and the gradient received."""
        module = self.modules[s]
        ddp = module if isinstance(module, DistributedDataParallel) else None
        ys, grads = _pairs(y, grad, s == self.n_stages - 1)
        if ddp is not None and ddp_last:
            # DDP arms its reducer at forward time; forwards ran under no_sync, so arm it
            # here for the one backward that should all-reduce (torch's pipelining does the same).
            ddp.reducer.prepare_for_backward(ys)
        elif ddp is not None:
            with ddp.no_sync():
                if ys:
                    torch.autograd.backward(ys, grads)
            return
        if ys:  # empty: nothing this stage sent needs a gradient
            torch.autograd.backward(ys, grads)


def _pairs(y, grad, last: bool) -> tuple[list, list]:
    """(outputs, gradients) for autograd: the loss alone on the last stage, else the output
    structure's floating tensors that require a gradient and received one."""
    if last:
        return [y], [None]
    return structure.backward_pairs(y, grad)


def _detach(y):
    """`y` with its tensors detached (a structure keeps its shape)."""
    tensors, spec = structure.flatten(y)
    return structure.unflatten([t.detach() for t in tensors], spec)


def _device_type(x) -> str:
    """The device type of a structure's first tensor (cpu without one), for autocast."""
    return next((t.device.type for t in structure.flatten(x, root="input")[0]), "cpu")


def _fp32(y):
    """`y` with its half-precision floating tensors upcast (through tuples, lists and dicts)."""
    if isinstance(y, torch.Tensor):
        return y.float() if y.is_floating_point() and y.element_size() < 4 else y
    if isinstance(y, tuple) and hasattr(y, "_fields"):  # a namedtuple
        return type(y)(*(_fp32(v) for v in y))
    if isinstance(y, (tuple, list)):
        return type(y)(_fp32(v) for v in y)
    if isinstance(y, dict):
        return {k: _fp32(v) for k, v in y.items()}
    return y
