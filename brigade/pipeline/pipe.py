"""User-facing pipelines: one stage per process, or all stages in one process.

    Pipeline       one process per stage, under torchrun or brigade.launch; P2P transport.
    LocalPipeline  the tutorial's "model parallel": stages on a list of devices in one
                   process, one worker thread per device, so stages overlap on CPU too.

Both build the schedule's plan once, validate it, and hand each stage its own
action list; `step(inputs, targets)` runs forward and backward of one batch and
returns the mean loss, `forward(inputs)` runs inference.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import nn

from brigade.errors import BrigadeError
from brigade.pipeline import microbatch
from brigade.pipeline.p2p import P2PTransport
from brigade.pipeline.plan import validate
from brigade.pipeline.runtime import StageRunner, StepResult
from brigade.pipeline.schedule import build, forward_only
from brigade.pipeline.transport import LocalTransport, StageAborted


def check_autocast(dtype) -> None:
    """Refuse an autocast dtype other than None, bf16 or fp16, in one line."""
    if dtype not in (None, torch.bfloat16, torch.float16):
        raise BrigadeError(f"autocast {dtype!r}: expected None (fp32), torch.bfloat16 or torch.float16")


class Pipeline:
    """This process's stage of a multi-process pipeline (stage = rank within `group`).

    Args:
        module: this stage's blocks, already on `device` (may be DDP-wrapped).
        schedule: a name in schedule.SCHEDULES; n_microbatches: micro-batches per step. Under
            zb a DDP-wrapped module's gradients are reduced by the runner's
            `GradientReducer` (DDP's reducer does not see a split backward).
        loss_fn: (output, target) -> mean loss, applied on the last stage.
        group: the pipeline's process group (default: the whole world).
        autocast: None (fp32), torch.bfloat16, or torch.float16, which needs a loss scale
            (`step(loss_scale=...)`; the Trainer's `LossScaler` picks it). The loss is fp32.

    Raises:
        BrigadeError: another autocast dtype.
    """

    def __init__(self, module: nn.Module, schedule: str, n_microbatches: int, loss_fn,
                 group=None, device: torch.device | str = "cpu", autocast: torch.dtype | None = None):
        check_autocast(autocast)
        self.group = group
        self.device = torch.device(device)
        self.n_stages = dist.get_world_size(group)
        self.stage = dist.get_rank(group)
        self.n_microbatches = n_microbatches
        self.peers = [dist.get_global_rank(group, i) if group else i for i in range(self.n_stages)]
        plans = validate(build(schedule, self.n_stages, n_microbatches)), \
            validate(forward_only(self.n_stages, n_microbatches))
        self.plan, self.inference_plan = (p[self.stage] for p in plans)
        transport = P2PTransport(self.peers, self.device, group, plans=plans)
        self.runner = StageRunner(module, self.stage, self.n_stages, transport, loss_fn, autocast)
        self.last_result: StepResult | None = None

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.n_stages - 1

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None,
             trace: bool = False, loss_scale: float = 1.0, sync: bool = True) -> torch.Tensor:
        """Forward and backward of one batch. Returns the batch's mean loss on every rank.

        Only the first stage reads `inputs` and only the last reads `targets`; others may pass None.
        `loss_scale` multiplies the loss before backward (1/k when accumulating k batches);
        `sync=False` skips the data-parallel gradient all-reduce (accumulation).
        """
        self.last_result = self._run(self.plan, inputs, targets, trace, loss_scale, sync)
        return self._share_loss(self.last_result, loss_scale)

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor:
        """Forward only; the batch's mean loss on every rank."""
        return self._share_loss(self._run(self.inference_plan, inputs, targets, False, 1.0, True), 1.0)

    @torch.no_grad()
    def forward(self, inputs: torch.Tensor | None) -> torch.Tensor | None:
        """Inference: returns the merged outputs on the last stage, None elsewhere."""
        xs = microbatch.split(inputs.to(self.device), self.n_microbatches) if self.is_first else None
        result = self.runner.run(self.inference_plan, xs, keep_outputs=self.is_last)
        return microbatch.merge(result.outputs) if self.is_last else None

    def _run(self, plan, inputs, targets, trace, loss_scale, sync) -> StepResult:
        m = self.n_microbatches
        xs = microbatch.split(inputs.to(self.device), m) if self.is_first else None
        ys = microbatch.split(targets.to(self.device), m) if self.is_last else None
        ws = [w * loss_scale for w in microbatch.weights(targets.shape[0], m)] if self.is_last else None
        return self.runner.run(plan, xs, ys, ws, trace=trace, sync=sync)

    def _share_loss(self, result: StepResult, loss_scale: float) -> torch.Tensor:
        loss = result.loss / loss_scale if self.is_last else torch.zeros((), device=self.device)
        loss = loss.detach().float().reshape(())
        if self.n_stages > 1:
            dist.broadcast(loss, self.peers[-1], group=self.group)
        return loss


class LocalPipeline:
    """All stages in this process, stage i on devices[i], one worker thread per device.

    Args:
        stages: one module per stage (moved to its device here).
        devices: one device per stage; "cpu" may repeat (each stage still gets a thread).
        schedule, n_microbatches, loss_fn, autocast: as for `Pipeline`.
    """

    def __init__(self, stages: list[nn.Module], devices: list[torch.device | str], schedule: str,
                 n_microbatches: int, loss_fn, timeout_s: float = 300.0, wrap=None,
                 autocast: torch.dtype | None = None):
        check_autocast(autocast)
        if len(devices) != len(stages):
            raise ValueError(f"{len(stages)} stages need {len(stages)} devices, got {len(devices)}")
        self.devices = [torch.device(d) for d in devices]
        self.stages = [s.to(d) for s, d in zip(stages, self.devices)]
        self.n_stages = len(stages)
        self.n_microbatches = n_microbatches
        self.transport = LocalTransport(self.devices, timeout_s)
        self.plan = validate(build(schedule, self.n_stages, n_microbatches))
        self.inference_plan = validate(forward_only(self.n_stages, n_microbatches))
        # `wrap(i, module)` may return a wrapper, e.g. DistributedDataParallel for dp × local-pp.
        modules = [wrap(i, s) if wrap else s for i, s in enumerate(self.stages)]
        self.runners = [
            StageRunner(s, i, self.n_stages, self.transport.endpoint(i), loss_fn, autocast)
            for i, s in enumerate(modules)
        ]
        self._pools = [ThreadPoolExecutor(1, thread_name_prefix=f"stage{i}") for i in range(self.n_stages)]
        self.last_results: list[StepResult] = []

    def _run_all(self, plan, xs, ys, ws, keep_outputs: bool, trace: bool,
                 sync: bool = True) -> list[StepResult]:
        def job(i: int) -> StepResult:
            if self.devices[i].type == "cuda":
                torch.cuda.set_device(self.devices[i])
            try:
                return self.runners[i].run(
                    plan[i],
                    xs if i == 0 else None,
                    ys if i == self.n_stages - 1 else None,
                    ws,
                    keep_outputs=keep_outputs and i == self.n_stages - 1,
                    trace=trace,
                    sync=sync,
                )
            except BaseException:
                self.transport.abort.set()  # unblock the other stages
                raise

        self.transport.abort.clear()
        futures = [pool.submit(job, i) for i, pool in enumerate(self._pools)]
        errors = [f.exception() for f in futures]
        # Raise the stage that failed first, not the neighbours it left waiting.
        root = [e for e in errors if e is not None and not isinstance(e, StageAborted)]
        if root or any(errors):
            raise (root or [e for e in errors if e])[0]
        return [f.result() for f in futures]

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, trace: bool = False,
             loss_scale: float = 1.0, sync: bool = True) -> torch.Tensor:
        """Forward and backward of one batch; returns the batch's mean loss (see Pipeline.step)."""
        m = self.n_microbatches
        xs = microbatch.split(inputs.to(self.devices[0]), m)
        ys = microbatch.split(targets.to(self.devices[-1]), m)
        ws = [w * loss_scale for w in microbatch.weights(targets.shape[0], m)]
        self.last_results = self._run_all(self.plan, xs, ys, ws, False, trace, sync)
        return (self.last_results[-1].loss / loss_scale).detach().float().reshape(())

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward only; the batch's mean loss."""
        m = self.n_microbatches
        xs = microbatch.split(inputs.to(self.devices[0]), m)
        ys = microbatch.split(targets.to(self.devices[-1]), m)
        results = self._run_all(self.inference_plan, xs, ys, microbatch.weights(targets.shape[0], m),
                                False, False)
        return results[-1].loss.detach().float().reshape(())

    @torch.no_grad()
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Inference: the merged outputs, on the last device."""
        xs = microbatch.split(inputs.to(self.devices[0]), self.n_microbatches)
        results = self._run_all(self.inference_plan, xs, None, None, True, False)
        return microbatch.merge(results[-1].outputs)

    def parameters(self):
        for s in self.stages:
            yield from s.parameters()

    def close(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=True)

    def __enter__(self) -> LocalPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
