"""One handler per op kind: what each action of a plan does on the rank that runs it.

`HANDLERS` maps every `Op` to a function `(runner, action, step)` (`runner` is the
`interpreter.StageRunner`, left unannotated so that this module need not import its caller);
`StageRunner.run` calls them in the plan's order and decides nothing itself. A forward takes
its input (the batch on stage 0, else what arrived or what the stage before it on this rank
left), runs the stage's blocks under the runner's autocast and random-draw context, and on the
last stage adds the weighted fp32 loss; a backward (whole B, or the split I then W) takes the
output it held and the gradient that came back, and passes its input gradient to the stage
before it: by reference on this rank, else to send.

    F ──► held[(s, mb)] = (x, y) ──► B, or I … W ──► grads[(s-1, mb)] here, or outgoing to send
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

from brigade.pipeline.plans.action import RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, I, Op, W
from brigade.pipeline.runtime.backward import backward_split
from brigade.pipeline.runtime.step import Step
from brigade.pipeline.stages import boundary, structure
from brigade.pipeline.stages.side_inputs import StageModule


def recv_forward(runner, a: Action, st: Step) -> None:
    st.acts[(a.stage, a.microbatch)] = runner.transport.recv(a)


def recv_backward(runner, a: Action, st: Step) -> None:
    st.grads[(a.stage, a.microbatch)] = runner.transport.recv(a)


def forward(runner, a: Action, st: Step) -> None:
    s, i = a.stage, a.microbatch
    x = st.inputs[i] if s == 0 else st.take(st.acts, a, "received activation")
    if st.training and s > 0:
        x = boundary.as_inputs(x)  # floating leaves require a gradient, integer ones pass
    with runner.draws(s, i, runner.modules[s]):  # the loss too: a loss may draw
        y = _run_forward(runner, s, x, st.side[i] if st.side else None)
        last = s == runner.n_stages - 1
        if last and st.keep_outputs:
            st.result.outputs.append(_detach(y))
        if last and st.targets is not None:
            y = _loss(runner, y, st.targets[i], st.weights[i] if st.weights else 1.0)
            st.total = y.detach() if st.total is None else st.total + y.detach()
    if not last and s + 1 in runner.modules:
        st.acts[(s + 1, i)] = _detach(y)  # the next stage is here: a reference, no message
    if st.training or (not last and s + 1 not in runner.modules):
        st.held[(s, i)] = (x, y)


def send_forward(runner, a: Action, st: Step) -> None:
    key = (a.stage, a.microbatch)
    held = st.held.get(key) if st.training else st.held.pop(key, None)
    if held is None:
        raise st.missing(a, "forward output")
    runner.transport.send(a, held[1])


def backward(runner, a: Action, st: Step) -> None:
    s = a.stage
    x, y = st.take(st.held, a, "forward output")
    grad = None if s == runner.n_stages - 1 else st.take(st.grads, a, "received gradient")
    last = st.finished(s) and st.sync
    _run_backward(runner, s, y, grad, ddp_last=last and s not in st.reducers)
    if last and s in st.reducers:
        st.reducers[s].ready(runner.params(s))  # starts now, overlaps what remains
    if s > 0:
        _pass_back(runner, a, boundary.input_grads(x), st)


def input_grad(runner, a: Action, st: Step) -> None:
    s = a.stage
    if (s, a.microbatch) not in st.held:
        raise st.missing(a, "forward output")
    x, y = st.held[(s, a.microbatch)]  # kept until W
    grad = None if s == runner.n_stages - 1 else st.take(st.grads, a, "received gradient")
    ys, grads = _pairs(y, grad, s == runner.n_stages - 1)
    leaves, spec = structure.flatten(x, root="input") if s > 0 else ([], None)
    dxs, st.weight_steps[(s, a.microbatch)] = backward_split(ys, grads, leaves, runner.params(s))
    if s > 0:  # integer leaves (and floating ones nothing depends on) get None
        _pass_back(runner, a, structure.unflatten(dxs, spec), st)


def weight_grad(runner, a: Action, st: Step) -> None:
    s = a.stage
    # Gradients are complete only in the stage's last weight pass of the step.
    last = st.finished(s) and s in st.reducers
    st.take(st.weight_steps, a, "input gradient (I)")(st.reducers[s].ready if last else None)
    st.held.pop((s, a.microbatch))


def send_backward(runner, a: Action, st: Step) -> None:
    runner.transport.send(a, st.take(st.outgoing, a, "input gradient"))


def _pass_back(runner, a: Action, dx, st: Step) -> None:
    """Hand stage s's input gradient to stage s-1: by reference if it is here, else to send."""
    if a.stage - 1 in runner.modules:
        st.grads[(a.stage - 1, a.microbatch)] = dx
    else:
        st.outgoing[(a.stage, a.microbatch)] = dx


def _run_forward(runner, s: int, x, side: dict | None):
    module = runner.modules[s]
    inner = module.module if isinstance(module, DistributedDataParallel) else module
    args = (x, side) if isinstance(inner, StageModule) else (x,)
    amp = contextlib.nullcontext() if runner.autocast is None else \
        torch.autocast(_device_type(x), dtype=runner.autocast)
    with amp:
        if isinstance(module, DistributedDataParallel):
            # Gradients are reduced once per step (see _run_backward and the reducers).
            with module.no_sync():
                return module(*args)
        return module(*args)


def _loss(runner, y, target: torch.Tensor, weight: float) -> torch.Tensor:
    """This micro-batch's weighted loss, in fp32 whatever the autocast dtype.

    The loss function runs outside autocast on the fp32 upcast of the output: a bf16
    cross-entropy is off by ~1e-2 at 4.6, and so would be the step's sum of such losses.
    """
    with torch.autocast(target.device.type, enabled=False):
        return _fp32(runner.loss_fn(_fp32(y), target)) * weight  # (a float64 loss stays float64)


def _run_backward(runner, s: int, y, grad, ddp_last: bool) -> None:
    """Backward of stage s from its output structure `y` (or loss) and the gradient received."""
    module = runner.modules[s]
    ddp = module if isinstance(module, DistributedDataParallel) else None
    ys, grads = _pairs(y, grad, s == runner.n_stages - 1)
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
    return boundary.backward_pairs(y, grad)


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


HANDLERS: dict[Op, object] = {RECV_F: recv_forward, RECV_B: recv_backward, F: forward, SEND_F: send_forward,
                              B: backward, I: input_grad, W: weight_grad, SEND_B: send_backward}
