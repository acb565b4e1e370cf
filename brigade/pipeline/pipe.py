"""User-facing pipelines: one rank per process, or all ranks in one process.

    Pipeline       one process per rank, under torchrun or brigade.launch; P2P transport.
    LocalPipeline  the tutorial's "model parallel": ranks on a list of devices in one
                   process, one worker thread per device, so stages overlap on CPU too.

A rank holds `virtual` stages (1, or several for interleaved, looped-bfs, zbv, dualpipev; the
schedule's placement says which). Both build the schedule's plan once, validate it, and
hand each rank its own action list; `step(inputs, targets)` runs forward and backward of
one batch and returns the mean loss, `forward(inputs)` runs inference. Inputs and targets
may be structures (tuples, dicts...); stages that are `side_inputs.StageModule`s get the side
inputs they declare from the batch (`feed`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import nn

from brigade.errors import BrigadeError
from brigade.pipeline.batches import feed, microbatch
from brigade.pipeline.plans.action import Op
from brigade.pipeline.plans.costs import median_durations
from brigade.pipeline.plans.schedule import SCHEDULES, build, forward_only, placement
from brigade.pipeline.plans.validate import validate
from brigade.pipeline.runtime.interpreter import StageRunner, StepResult
from brigade.pipeline.runtime.randomness import StageRandom
from brigade.pipeline.transport.local import LocalTransport, StageAborted
from brigade.pipeline.transport.p2p import P2PTransport


def check_autocast(dtype) -> None:
    """Refuse an autocast dtype other than None, bf16 or fp16, in one line."""
    if dtype not in (None, torch.bfloat16, torch.float16):
        raise BrigadeError(f"autocast {dtype!r}: expected None (fp32), torch.bfloat16 or torch.float16")


class Pipeline:
    """This process's rank of a multi-process pipeline (rank within `group`).

    Args:
        module: this rank's stage, already on `device` (may be DDP-wrapped); or, when the
            rank holds several stages, {global stage index: module} for exactly those
            (`schedule.stages_on` lists them).
        schedule: a name in schedule.SCHEDULES; n_microbatches: micro-batches per step. Under
            zb a DDP-wrapped module's gradients are reduced by the runner's
            `GradientReducer` (DDP's reducer does not see a split backward).
        loss_fn: (output, target) -> mean loss, applied on the last stage.
        group: the pipeline's process group (default: the whole world).
        autocast: None (fp32), torch.bfloat16, or torch.float16, which needs a loss scale
            (`step(loss_scale=...)`; the Trainer's `LossScaler` picks it). The loss is fp32.
        virtual: stages per rank (0: the schedule's own: 1, or 2 for interleaved, looped-bfs,
            zbv, dualpipev).
        side_inputs: every side input the model's blocks declare → the block, as messages name it
            (`feed.declarations` over all stages); None: gathered from the ranks here, once.
        costs: what a costed schedule (`auto`) is planned on (`plans.costs.Costs`), the same on
            every rank; None: unit costs. Other schedules ignore it.
        parts: context parallel's cut of every micro-batch and mean of the parts' losses
            (`feed.Feed`, `parallel.context.ContextParallel`); None: whole sequences.

    Raises:
        BrigadeError: another autocast dtype, or modules for other stages than this rank's.
        PlanError: a V the schedule cannot run.
    """

    def __init__(self, module: nn.Module | dict[int, nn.Module], schedule: str, n_microbatches: int,
                 loss_fn, group=None, device: torch.device | str = "cpu",
                 autocast: torch.dtype | None = None, virtual: int = 0,
                 side_inputs: Mapping[str, str] | None = None, costs=None, parts=None):
        check_autocast(autocast)
        self.group = group
        self.device = torch.device(device)
        n_ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.virtual, ranks = placement(schedule, n_ranks, virtual)
        self.n_stages = len(ranks)
        self.stages = [s for s, r in enumerate(ranks) if r == self.rank]
        modules = _modules_for(module, self.stages, self.rank, schedule, self.virtual)
        self.n_microbatches = n_microbatches
        self.schedule, self.n_ranks = schedule, n_ranks
        self.peers = [dist.get_global_rank(group, r) if group else r for r in ranks]
        plans = validate(build(schedule, n_ranks, n_microbatches, self.virtual, costs)), \
            validate(forward_only(self.n_stages, n_microbatches, ranks))
        self.plan, self.inference_plan = (p[self.rank] for p in plans)
        self.transport = P2PTransport(self.peers, self.device, group, plans=plans)
        # A costed schedule's plan changes with the costs, and with it the order in which a rank's
        # stages run their forwards: each forward then draws from a stream of its own (`randomness`),
        # so a run's dropout masks do not depend on which plan it had when.
        self.random = StageRandom([self.device], order_free=True) \
            if SCHEDULES[schedule].costed and len(self.stages) > 1 else None
        self.runner = StageRunner(modules, self.n_stages, self.transport, loss_fn, autocast,
                                  draws=self.random.forward if self.random else None)
        declared = dict(side_inputs) if side_inputs is not None else self._gather(modules, n_ranks)
        self.feed = feed.Feed(modules, declared, feed.first_label(modules.get(0)), parts)
        self.parts = parts
        self.last_result: StepResult | None = None

    def _gather(self, modules: dict[int, nn.Module], n_ranks: int) -> dict[str, str]:
        """Every rank's side-input declarations: the first stage must know them all to find
        the main input among the batch's inputs."""
        own = feed.declarations(modules)
        if n_ranks == 1:
            return own
        parts: list = [None] * n_ranks
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            dist.all_gather_object(parts, own, group=self.group)
        return feed.merge(parts)

    def replan(self, costs) -> None:
        """Plan the schedule again on `costs` (`plans.costs.Costs`, the same on every rank); the next
        steps run the new plan. Only a costed schedule's plan changes."""
        plan = validate(build(self.schedule, self.n_ranks, self.n_microbatches, self.virtual, costs))
        self.transport.also_run(plan)
        self.plan = plan[self.rank]

    def timings(self) -> dict[tuple[int, Op], float]:
        """(stage, op) -> seconds of each compute action kind of this rank's stages, the median
        over the micro-batches of the last step run with `trace=True`."""
        return median_durations(self.last_result.trace if self.last_result else [])

    @property
    def stage(self) -> int:
        """This rank's first stage (its only one when V = 1)."""
        return self.stages[0]

    @property
    def is_first(self) -> bool:
        """This rank holds stage 0 (it reads the inputs)."""
        return 0 in self.stages

    @property
    def is_last(self) -> bool:
        """This rank holds the last stage (it reads the targets and computes the loss)."""
        return self.n_stages - 1 in self.stages

    def step(self, inputs, targets, trace: bool = False, loss_scale: float = 1.0,
             sync: bool = True) -> torch.Tensor:
        """Forward and backward of one batch. Returns the batch's mean loss on every rank.

        `inputs` and `targets` are tensors or structures. Only the first stage reads `inputs`
        (and ranks whose stages take side inputs), only the last reads `targets`; others may
        pass None.
        `loss_scale` multiplies the loss before backward (1/k when accumulating k batches);
        `sync=False` skips the data-parallel gradient all-reduce (accumulation).
        """
        self.last_result = self._run(self.plan, inputs, targets, trace, loss_scale, sync)
        return self._share_loss(self.last_result, loss_scale)

    @torch.no_grad()
    def evaluate(self, inputs, targets) -> torch.Tensor:
        """Forward only; the batch's mean loss on every rank."""
        return self._share_loss(self._run(self.inference_plan, inputs, targets, False, 1.0, True), 1.0)

    @torch.no_grad()
    def forward(self, inputs):
        """Inference: returns the merged outputs on the last stage, None elsewhere (under context
        parallel, this process's part of each sequence's)."""
        m = self.n_microbatches
        xs = self.feed.inputs(inputs, m, self.device) if self.is_first else None
        side = self.feed.side(inputs, m, self.stages, self.device)
        if self.random:
            self.random.begin(training=False)
        result = self.runner.run(self.inference_plan, xs, keep_outputs=self.is_last, side=side)
        if self.random:
            self.random.end()
        return microbatch.merge_structure(result.outputs) if self.is_last else None

    def _run(self, plan, inputs, targets, trace, loss_scale, sync) -> StepResult:
        m = self.n_microbatches
        xs = self.feed.inputs(inputs, m, self.device) if self.is_first else None
        side = self.feed.side(inputs, m, self.stages, self.device)
        ys, ws = self.feed.targets(targets, m, self.device, loss_scale) if self.is_last else (None, None)
        if self.random:
            self.random.begin(training=plan is self.plan)
        result = self.runner.run(plan, xs, ys, ws, trace=trace, sync=sync, side=side)
        if self.random:
            self.random.end()
        return result

    def _share_loss(self, result: StepResult, loss_scale: float) -> torch.Tensor:
        loss = result.loss / loss_scale if self.is_last else torch.zeros((), device=self.device)
        loss = loss.detach().float().reshape(())
        if self.parts is not None and self.is_last:  # the parts' mean: the whole sequences' loss
            loss = self.parts.mean(loss)
        if len(set(self.peers)) > 1:
            dist.broadcast(loss, self.peers[-1], group=self.group)
        return loss


def _modules_for(module, stages: list[int], rank: int, schedule: str, virtual: int) -> dict[int, nn.Module]:
    """{stage: module} for this rank's stages, from one module (one stage) or a dict."""
    if isinstance(module, nn.Module) and len(stages) == 1:
        return {stages[0]: module}
    got = sorted(module) if isinstance(module, dict) else "one module"
    if got != stages:
        raise BrigadeError(f"rank {rank} holds stages {stages} under {schedule} with {virtual} per rank "
                           f"but was given {got}: pass {{stage: module}} for exactly those stages")
    return dict(module)


class LocalPipeline:
    """All stages in this process, one worker thread per device; the schedule's placement puts
    stage s on devices[rank of s] (stage i on devices[i] when V = 1). Threads that share a
    generator (the CPU's; a GPU's that several ranks sit on) draw dropout masks from a stream
    per (step, stage, micro-batch), so a run repeats bit for bit whatever their timing
    (`randomness`).

    Args:
        stages: one module per stage, len(devices) × V of them (moved to their devices here).
        devices: one device per rank; "cpu" may repeat (each still gets a thread).
        schedule, n_microbatches, loss_fn, autocast, virtual, costs: as for `Pipeline`.
        wrap: `wrap(stage, module)` may return a wrapper (DistributedDataParallel for dp × local).

    Raises:
        BrigadeError: a number of stages other than devices × V.
    """

    def __init__(self, stages: list[nn.Module], devices: list[torch.device | str], schedule: str,
                 n_microbatches: int, loss_fn, timeout_s: float = 300.0, wrap=None,
                 autocast: torch.dtype | None = None, virtual: int = 0, costs=None):
        check_autocast(autocast)
        self.virtual, ranks = placement(schedule, len(devices), virtual)
        if len(ranks) != len(stages):
            raise BrigadeError(f"{len(stages)} stages on {len(devices)} devices with {self.virtual} "
                               f"stage(s) per device: need {len(ranks)} stages")
        self.devices = [torch.device(d) for d in devices]
        self.stage_devices = [self.devices[r] for r in ranks]
        self.stages = [s.to(d) for s, d in zip(stages, self.stage_devices)]
        self.n_stages = len(stages)
        self.n_ranks = len(devices)
        self.n_microbatches = n_microbatches
        self.schedule = schedule
        self.transport = LocalTransport(self.stage_devices, timeout_s)
        self.plan = validate(build(schedule, self.n_ranks, n_microbatches, self.virtual, costs))
        self.inference_plan = validate(forward_only(self.n_stages, n_microbatches, ranks))
        modules = [wrap(i, s) if wrap else s for i, s in enumerate(self.stages)]
        self.random = StageRandom(self.devices)  # threads that share a generator draw apart
        self.runners = [
            StageRunner({s: modules[s] for s in range(self.n_stages) if ranks[s] == r}, self.n_stages,
                        self.transport.endpoint(), loss_fn, autocast, draws=self.random.forward)
            for r in range(self.n_ranks)
        ]
        self.first, self.last = ranks[0], ranks[-1]  # the ranks reading inputs and targets
        self.rank_stages = [[s for s in range(self.n_stages) if ranks[s] == r] for r in range(self.n_ranks)]
        stage_map = dict(enumerate(self.stages))
        self.feed = feed.Feed(stage_map, feed.declarations(stage_map), feed.first_label(self.stages[0]))
        self._pools = [ThreadPoolExecutor(1, thread_name_prefix=f"device{r}") for r in range(self.n_ranks)]
        self.last_results: list[StepResult] = []

    def _feed(self, inputs, targets, loss_scale: float = 1.0):
        """(inputs, per-rank side inputs, targets, weights) of a batch, micro-batched and placed."""
        m, f = self.n_microbatches, self.feed
        xs = f.inputs(inputs, m, self.stage_devices[0])
        sides = [f.side(inputs, m, stages, self.devices[r]) for r, stages in enumerate(self.rank_stages)]
        ys, ws = f.targets(targets, m, self.stage_devices[-1], loss_scale) if targets is not None \
            else (None, None)
        return xs, sides, ys, ws

    def _run_all(self, plan, xs, ys, ws, keep_outputs: bool, trace: bool,
                 sync: bool = True, sides: list | None = None) -> list[StepResult]:
        def job(r: int) -> StepResult:
            if self.devices[r].type == "cuda":
                torch.cuda.set_device(self.devices[r])
            try:
                return self.runners[r].run(
                    plan[r],
                    xs if r == self.first else None,
                    ys if r == self.last else None,
                    ws,
                    keep_outputs=keep_outputs and r == self.last,
                    trace=trace,
                    sync=sync,
                    side=sides[r] if sides else None,
                )
            except BaseException:
                self.transport.abort.set()  # unblock the other stages
                raise

        self.transport.abort.clear()
        self.random.begin(training=plan is self.plan)
        futures = [pool.submit(job, i) for i, pool in enumerate(self._pools)]
        errors = [f.exception() for f in futures]
        # Raise the stage that failed first, not the neighbours it left waiting.
        root = [e for e in errors if e is not None and not isinstance(e, StageAborted)]
        if root or any(errors):
            raise (root or [e for e in errors if e])[0]
        self.random.end()
        return [f.result() for f in futures]

    def step(self, inputs, targets, trace: bool = False, loss_scale: float = 1.0,
             sync: bool = True) -> torch.Tensor:
        """Forward and backward of one batch; returns the batch's mean loss (see Pipeline.step).

        Raises:
            BrigadeError: targets=None, or inputs that do not fit the stages (`feed`)."""
        if targets is None:
            raise BrigadeError("LocalPipeline.step(inputs, None): pass the batch's targets")
        xs, sides, ys, ws = self._feed(inputs, targets, loss_scale)
        self.last_results = self._run_all(self.plan, xs, ys, ws, False, trace, sync, sides)
        return (self.last_results[self.last].loss / loss_scale).detach().float().reshape(())

    def replan(self, costs) -> None:
        """Plan the schedule again on `costs` (see Pipeline.replan)."""
        self.plan = validate(build(self.schedule, self.n_ranks, self.n_microbatches, self.virtual, costs))

    def timings(self) -> dict[tuple[int, Op], float]:
        """(stage, op) -> median seconds over the last traced step, every stage (see Pipeline.timings)."""
        return median_durations([e for result in self.last_results for e in result.trace])

    @torch.no_grad()
    def evaluate(self, inputs, targets) -> torch.Tensor:
        """Forward only; the batch's mean loss."""
        xs, sides, ys, ws = self._feed(inputs, targets)
        results = self._run_all(self.inference_plan, xs, ys, ws, False, False, sides=sides)
        return results[self.last].loss.detach().float().reshape(())

    @torch.no_grad()
    def forward(self, inputs):
        """Inference: the merged outputs, on the last device."""
        xs, sides, _, _ = self._feed(inputs, None)
        results = self._run_all(self.inference_plan, xs, None, None, True, False, sides=sides)
        return microbatch.merge_structure(results[self.last].outputs)

    def parameters(self):
        for s in self.stages:
            yield from s.parameters()

    def close(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=True)
        self.random.close()

    def __enter__(self) -> LocalPipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
