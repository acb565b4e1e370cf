"""The interpreter: runs one stage's list of actions for one step.

`StageRunner.run` walks the actions in order and hands each to the handler of
its kind (`_HANDLERS`, as torch's `_perform_action` does); it never decides the
order itself, so every schedule runs through this one loop. It talks to
neighbours only through a transport (`send`, `recv`, `flush`), so the same code
serves processes and device threads.

Loss convention: on the last stage each micro-batch's mean loss is multiplied
by its share of the batch (`microbatch.weights`) before backward, so the
gradients add up to those of the mean loss over the whole batch.
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
from brigade.pipeline.backward import GradientReducer, backward_split
from brigade.pipeline.schedule import COMM_OPS, RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, I, PlanError, W
from brigade.pipeline.transport import Transport


@dataclass
class StepResult:
    """What one stage got out of one step."""

    loss: torch.Tensor | None = None  # last stage: weighted sum of micro-batch losses
    outputs: list[torch.Tensor] = field(default_factory=list)  # last stage, if asked
    trace: list[tuple[Action, float, float]] = field(default_factory=list)


@dataclass
class _Step:
    """One step's state, shared by the action handlers of `StageRunner`."""

    actions: list[Action]
    inputs: list[torch.Tensor] | None
    targets: list[torch.Tensor] | None
    weights: list[float] | None
    keep_outputs: bool
    sync: bool
    result: StepResult = field(default_factory=StepResult)
    held: dict[int, tuple] = field(default_factory=dict)  # mb -> (stage input, output or loss)
    inbox: dict[int, torch.Tensor] = field(default_factory=dict)  # received activations or gradients
    weight_steps: dict[int, Callable] = field(default_factory=dict)  # mb -> its pending W
    total: torch.Tensor | None = None
    reducer: GradientReducer | None = None
    backward_done: int = 0
    weight_done: int = 0

    def __post_init__(self) -> None:
        self.training = any(a.op in (B, I) for a in self.actions)
        self.n_backward = sum(a.op == B for a in self.actions)
        self.n_weight = sum(a.op == W for a in self.actions)

    def take(self, store: dict, a: Action, what: str):
        """Remove and return micro-batch `a.microbatch`'s entry, or name the action that lacks it."""
        if a.microbatch not in store:
            raise self.missing(a, what)
        return store.pop(a.microbatch)

    @staticmethod
    def missing(a: Action, what: str) -> PlanError:
        return PlanError(f"{a}: no {what} for micro-batch {a.microbatch} on stage {a.stage} at this point: "
                         "the action list is out of order (check it with brigade.pipeline.plan.validate)")


_HANDLERS = {RECV_F: "_on_recv", RECV_B: "_on_recv", F: "_on_forward", SEND_F: "_on_send_forward",
             B: "_on_backward", I: "_on_input_grad", W: "_on_weight_grad", SEND_B: "_on_send_backward"}


class StageRunner:
    """Runs one stage's actions.

    Args:
        module: this stage's blocks (possibly wrapped in DistributedDataParallel).
        stage: index of this stage; n_stages: pipeline depth.
        transport: a `Transport` (P2P between processes, or a local endpoint).
        loss_fn: (output, target) -> mean loss; used on the last stage only.
    """

    def __init__(self, module: nn.Module, stage: int, n_stages: int, transport: Transport, loss_fn=None,
                 autocast: torch.dtype | None = None):
        self.module = module
        self.stage = stage
        self.n_stages = n_stages
        self.transport = transport
        self.loss_fn = loss_fn
        self.is_first = stage == 0
        self.is_last = stage == n_stages - 1
        self.autocast = autocast  # e.g. torch.bfloat16 on GPUs
        # Split backwards (I/W) bypass DDP's reducer; this reduces in its place, same group
        # and bucket size, once per step after the weight passes.
        self.split_reducer = GradientReducer(module.module.parameters(), module.process_group,
                                             module.bucket_bytes_cap) \
            if isinstance(module, DistributedDataParallel) else None

    def run(
        self,
        actions: list[Action],
        inputs: list[torch.Tensor] | None = None,
        targets: list[torch.Tensor] | None = None,
        weights: list[float] | None = None,
        keep_outputs: bool = False,
        trace: bool = False,
        sync: bool = True,
    ) -> StepResult:
        """Execute `actions` (with comms inserted) for one step.

        Args:
            inputs: the micro-batches (first stage only).
            targets: the micro-batch targets (last stage only; omit for pure inference).
            weights: each micro-batch's share of the batch (last stage, with targets).
            keep_outputs: keep the last stage's outputs (inference).
            trace: record (action, start, end) in perf_counter seconds.
            sync: under DistributedDataParallel, all-reduce gradients on this step's last
                backward; False while accumulating gradients over several steps.

        Raises:
            PlanError: an action needs what no earlier action made (a B before its F, ...).
        """
        st = _Step(actions, inputs, targets, weights, keep_outputs, sync)
        st.reducer = self.split_reducer if sync and st.n_weight else None
        if st.reducer is not None:
            st.reducer.reset()
        self.transport.begin_step(actions, inputs if self.is_first else None)
        with contextlib.nullcontext() if st.training else torch.no_grad():
            for a in actions:
                self._record(a)
                start = time.perf_counter() if trace else 0.0
                getattr(self, _HANDLERS[a.op])(a, st)
                if trace:
                    st.result.trace.append((a, start, time.perf_counter()))
            forensics.doing(f"flush sends (stage {self.stage})", waiting=True)
            self.transport.flush()
        if st.reducer is not None:
            st.reducer.finish()  # before anyone reads .grad (norm, clipping, optimizer)
        st.result.loss = st.total
        return st.result

    # --- one handler per action kind (`_HANDLERS`); each reads and updates the step's state ---

    def _on_recv(self, a: Action, st: _Step) -> None:
        st.inbox[a.microbatch] = self.transport.recv(self.stage + (-1 if a.op == RECV_F else 1))

    def _on_forward(self, a: Action, st: _Step) -> None:
        i = a.microbatch
        x = st.inputs[i] if self.is_first else st.take(st.inbox, a, "received activation")
        if st.training and not self.is_first and x.is_floating_point():
            x.requires_grad_(True)
        y = self._forward(x)
        if self.is_last:
            if st.keep_outputs:
                st.result.outputs.append(y.detach())
            if st.targets is not None:
                y = self._loss(y, st.targets[i], st.weights[i] if st.weights else 1.0)
                st.total = y.detach() if st.total is None else st.total + y.detach()
        if st.training or not self.is_last:
            st.held[i] = (x, y)

    def _on_send_forward(self, a: Action, st: _Step) -> None:
        held = st.held.get(a.microbatch) if st.training else st.held.pop(a.microbatch, None)
        if held is None:
            raise st.missing(a, "forward output")
        self.transport.send(held[1], self.stage + 1)

    def _on_backward(self, a: Action, st: _Step) -> None:
        st.backward_done += 1
        x, y = st.take(st.held, a, "forward output")
        grad = None if self.is_last else st.take(st.inbox, a, "received gradient")
        self._backward(y, grad, last=st.sync and st.backward_done == st.n_backward)
        if not self.is_first:
            st.inbox[a.microbatch] = x.grad

    def _on_input_grad(self, a: Action, st: _Step) -> None:
        if a.microbatch not in st.held:
            raise st.missing(a, "forward output")
        x, y = st.held[a.microbatch]  # kept until W
        grad = None if self.is_last else st.take(st.inbox, a, "received gradient")
        dx, st.weight_steps[a.microbatch] = backward_split(
            y, grad, None if self.is_first else x, list(self.module.parameters()))
        if not self.is_first:
            st.inbox[a.microbatch] = dx

    def _on_weight_grad(self, a: Action, st: _Step) -> None:
        st.weight_done += 1
        # Gradients are complete only in the step's last weight pass.
        last_w = st.reducer is not None and st.weight_done == st.n_weight
        st.take(st.weight_steps, a, "input gradient (I)")(st.reducer.ready if last_w else None)
        st.held.pop(a.microbatch)

    def _on_send_backward(self, a: Action, st: _Step) -> None:
        self.transport.send(st.take(st.inbox, a, "input gradient"), self.stage - 1)

    def _record(self, a: Action) -> None:
        """Tell the hang watchdog what this stage does now, naming the peer a transfer waits on."""
        if a.op not in COMM_OPS:
            forensics.doing(f"{a.op} mb{a.microbatch} (stage {self.stage})")
            return
        peer = self.stage - 1 if a.op in (RECV_F, SEND_B) else self.stage + 1
        ranks = self.transport.peers
        rank = ranks[peer] if ranks else None
        where = f"{'from' if a.op in (RECV_F, RECV_B) else 'to'} stage {peer}"
        forensics.doing(f"{a.op} mb{a.microbatch} {where}" + (f" (rank {rank})" if ranks else ""),
                        waiting=True, on=rank)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        amp = contextlib.nullcontext() if self.autocast is None else \
            torch.autocast(x.device.type, dtype=self.autocast)
        with amp:
            if isinstance(self.module, DistributedDataParallel):
                # Gradients are reduced once per step, on the last backward (see _backward).
                with self.module.no_sync():
                    return self.module(x)
            return self.module(x)

    def _loss(self, y, target: torch.Tensor, weight: float) -> torch.Tensor:
        """This micro-batch's weighted loss, in fp32 whatever the autocast dtype.

        The loss function runs outside autocast on the fp32 upcast of the output: a bf16
        cross-entropy is off by ~1e-2 at 4.6, and so would be the step's sum of such losses.
        """
        with torch.autocast(target.device.type, enabled=False):
            return _fp32(self.loss_fn(_fp32(y), target)) * weight  # (a float64 loss stays float64)

    def _backward(self, y: torch.Tensor, grad: torch.Tensor | None, last: bool) -> None:
        ddp = self.module if isinstance(self.module, DistributedDataParallel) else None
        if ddp is None:
            torch.autograd.backward(y, grad)
        elif last:
            # DDP arms its reducer at forward time; forwards ran under no_sync, so arm it
            # here for the one backward that should all-reduce (torch's pipelining does the same).
            ddp.reducer.prepare_for_backward([y])
            torch.autograd.backward(y, grad)
        else:
            with ddp.no_sync():
                torch.autograd.backward(y, grad)


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
