"""The interpreter: runs one stage's list of actions for one step.

`StageRunner.run` walks the actions in order and does exactly what each says;
it never decides the order itself, so every schedule runs through this one
loop. It talks to neighbours only through a transport (`send`, `recv`,
`flush`), so the same code serves processes and device threads.

Loss convention: on the last stage each micro-batch's mean loss is multiplied
by its share of the batch (`microbatch.weights`) before backward, so the
gradients add up to those of the mean loss over the whole batch.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from brigade import forensics
from brigade.pipeline.backward import GradientReducer, backward_split
from brigade.pipeline.schedule import COMM_OPS, RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, I, W
from brigade.pipeline.transport import Transport


@dataclass
class StepResult:
    """What one stage got out of one step."""

    loss: torch.Tensor | None = None  # last stage: weighted sum of micro-batch losses
    outputs: list[torch.Tensor] = field(default_factory=list)  # last stage, if asked
    trace: list[tuple[Action, float, float]] = field(default_factory=list)


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
        """
        training = any(a.op in (B, I) for a in actions)
        weight_steps: dict[int, object] = {}
        n_weight, weight_done = sum(a.op == W for a in actions), 0
        reducer = self.split_reducer if sync and n_weight else None
        if reducer is not None:
            reducer.reset()
        result = StepResult()
        held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # mb -> (stage input, output or loss)
        inbox: dict[int, torch.Tensor] = {}  # received activations or gradients
        n_backward = sum(a.op == B for a in actions)
        backward_done = 0
        total = None
        grad_ctx = contextlib.nullcontext() if training else torch.no_grad()
        self.transport.begin_step(actions, inputs if self.is_first else None)
        with grad_ctx:
            for a in actions:
                self._record(a)
                start = time.perf_counter() if trace else 0.0
                i = a.microbatch
                if a.op in (RECV_F, RECV_B):
                    inbox[i] = self.transport.recv(self.stage + (-1 if a.op == RECV_F else 1))
                elif a.op == F:
                    x = inputs[i] if self.is_first else inbox.pop(i)
                    if training and not self.is_first and x.is_floating_point():
                        x.requires_grad_(True)
                    y = self._forward(x)
                    if self.is_last:
                        if keep_outputs:
                            result.outputs.append(y.detach())
                        if targets is not None:
                            y = self._loss(y, targets[i], weights[i] if weights else 1.0)
                            total = y.detach() if total is None else total + y.detach()
                    if training or not self.is_last:
                        held[i] = (x, y)
                elif a.op == SEND_F:
                    _, y = held[i] if training else held.pop(i)
                    self.transport.send(y, self.stage + 1)
                elif a.op == B:
                    backward_done += 1
                    x, y = held.pop(i)
                    grad = None if self.is_last else inbox.pop(i)
                    self._backward(y, grad, last=sync and backward_done == n_backward)
                    if not self.is_first:
                        inbox[i] = x.grad
                elif a.op == I:
                    x, y = held[i]  # kept until W
                    grad = None if self.is_last else inbox.pop(i)
                    dx, weight_steps[i] = backward_split(
                        y, grad, None if self.is_first else x, list(self.module.parameters()))
                    if not self.is_first:
                        inbox[i] = dx
                elif a.op == W:
                    weight_done += 1
                    # Gradients are complete only in the step's last weight pass.
                    last_w = reducer is not None and weight_done == n_weight
                    weight_steps.pop(i)(reducer.ready if last_w else None)
                    held.pop(i)
                elif a.op == SEND_B:
                    self.transport.send(inbox.pop(i), self.stage - 1)
                if trace:
                    result.trace.append((a, start, time.perf_counter()))
            forensics.doing(f"flush sends (stage {self.stage})", waiting=True)
            self.transport.flush()
        if reducer is not None:
            reducer.finish()  # before anyone reads .grad (norm, clipping, optimizer)
        result.loss = total
        return result

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
