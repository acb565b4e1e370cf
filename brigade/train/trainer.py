"""The training loop: model-agnostic, the same in every layout.

A Trainer takes blocks, a loss function, datasets and an optimizer factory;
`ProcessModel` (process_model.py) holds this process's part of the model, `World` its
place. Each optimizer step:

    global batch → this replica's slice → grad_accum chunks, each forward/backward (gradients add up)
    clip the whole model's gradient norm → optimizer step → LR schedule → metrics
    every eval_every steps: validation loss; every snapshot_every steps: snapshot

A dataset is anything with `len()` and `batch(indices) -> (inputs, targets)`,
or a map-style torch Dataset whose items are (input, target) pairs.
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from brigade import forensics
from brigade.config import (
    Launched,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
    elastic,
    resolve_layout,
)
from brigade.config.precision import autocast_dtype
from brigade.config.validate import logs
from brigade.data.sampler import Sampler, fingerprint
from brigade.errors import RunError
from brigade.launcher import groups
from brigade.pipeline.stages import structure
from brigade.train.experts import ExpertStats
from brigade.train.memory import StepMemory
from brigade.train.metrics import Metrics
from brigade.train.optimizer import adamw, lr_at
from brigade.train.precision import LossScaler
from brigade.train.process_model import ProcessModel, by_device, world_of


def _batch(data, indices: torch.Tensor):
    if hasattr(data, "batch"):
        return data.batch(indices)
    items = [data[int(i)] for i in indices]
    return torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])


def sample_of(data):
    """The first sample of `data`, as a batch of one (x, y)."""
    return _batch(data, torch.zeros(1, dtype=torch.long))


class NonFiniteError(RunError):
    """The loss or gradient norm of a step is NaN or infinite; the step was not taken."""

    def __init__(self, what: str, value: float, step: int, lr: float):
        self.what, self.value, self.step, self.lr = what, value, step, lr
        super().__init__(f"the {what} is {value} at step {step}; the parameters were not updated: "
                         f"lower --lr (now {lr:g}), set --grad-clip, or check the data")


@dataclass
class State:
    step: int = 0
    cursor: int = 0
    history: list[dict] = field(default_factory=list)


class Trainer:
    """Train `blocks` with `loss_fn` on `train_data`; works under brigade.launch or torchrun.

    Args:
        blocks: the model as an ordered list of modules, built identically on every process.
        loss_fn: (output, target) -> mean loss.
        train_data, val_data: datasets (see module docstring); val_data may be None.
        parallel, optim, train: configuration (defaults if omitted).
        optimizer: factory `model -> Optimizer` (default AdamW from `optim`).
        callbacks: functions called as `cb(trainer, record)` after each step and evaluation.
        weights: fills this process's blocks once placed (`data.Built.weights`: a Hugging Face
            directory's tensors into blocks built without memory); None: the blocks have theirs.
        adapters: --lora's adapters (`parallel.lora.LoraSpec`), only they train; None: every weight.
    """

    def __init__(self, blocks: list[nn.Module], loss_fn, train_data, val_data=None,
                 parallel: ParallelConfig | None = None, optim: OptimConfig | None = None,
                 train: TrainConfig | None = None, optimizer=None, callbacks=(), metrics: bool = True,
                 weights=None, adapters=None):
        self.parallel = parallel or ParallelConfig(nproc=1)
        self.optim_cfg = optim or OptimConfig()
        self.cfg = train or TrainConfig()
        if not dist.is_initialized():
            groups.init(self.parallel.backend, self.parallel.threads, local_stages=self.parallel.local_stages)
        self.info = groups.info(self.parallel.backend, self.parallel.local_stages)
        self._resolve_layout()
        self.world = world_of(self.parallel, self.info.device)  # where this process sits, its groups
        # Every random stream is seeded, per rank: dropout (torch), and Python's / numpy's for user code.
        # The tp processes of one stage share a stream (`World.stream`): the activations they hold
        # whole must get the same dropout masks on each.
        stream = self.cfg.seed + 1000 * self.world.stream
        torch.manual_seed(stream)
        random.seed(stream)
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed(stream)
        autocast = autocast_dtype(self.cfg.precision, self.cfg.bf16, self.info.device.type)
        self.scaler = LossScaler() if autocast == torch.float16 else None
        self.engine = ProcessModel(blocks, loss_fn, self.parallel, self.world, autocast=autocast,
                                   weights=weights, sample=self._sample(train_data), adapters=adapters)
        self.model = self.engine.owned
        self.experts = ExpertStats(blocks)  # a mixture of experts' figures, each step (none without)
        self.optimizer = (optimizer or adamw(self.optim_cfg))(self.model)
        self.train_data, self.val_data = train_data, val_data
        self.state = State()
        self.sampler = Sampler(len(train_data), self.cfg.batch_size, self.cfg.seed)
        self.callbacks = list(callbacks)
        self.utilization = None  # train.mfu.Utilization: the records' MFU, where the run gives one
        self.before_step: list[Callable[[int], None]] = []  # called with the step about to run
        self.stop_requested = False  # set by a callback to end fit() after this step
        # The step whose memory is measured and logged: the second (its optimizer state exists at
        # its start, as in every later step), or the first of a one-step run; 0: none.
        self.memory_step = min(2, self.cfg.max_steps)
        self.memory_report: list[dict] | None = None  # every rank's memory (StepMemory.report), once measured
        # A costed schedule (auto) is planned again on the times of this process's second step
        # (its first warms up), or of the first after the memory step (that one runs slower).
        self.replan_pending = self.engine.costed
        self.steps_here = 0
        self.is_main = dist.get_rank() == 0
        self.metrics = Metrics(self.cfg.out if metrics and self.is_main else None, self.cfg.max_steps,
                               tensorboard=self.cfg.tensorboard, log=logs(self.cfg.log))
        self.watchdog = forensics.start(self.parallel.hang_timeout, self.cfg.out,
                                        self.world.place)

    def _sample(self, data):
        """One micro-batch's inputs (the first samples), what a costed schedule without --balance
        measures its cut on (`process_model.cut_of`)."""
        p = self.parallel
        size = max(1, self.cfg.batch_size // max(1, p.dp * self.optim_cfg.grad_accum * p.microbatches))
        return _batch(data, torch.arange(min(size, len(data))))[0]

    def _resolve_layout(self) -> None:
        """dp = 0: derived from the process group's world by `config.resolve_layout`, the one owner;
        gradient accumulation for that dp by `elastic.accumulation` (an elastic run keeps its
        global batch: fewer replicas, more accumulation steps)."""
        run = RunConfig(parallel=self.parallel, optim=self.optim_cfg, train=self.cfg)
        world = Launched(dist.get_world_size(), launcher="the process group")
        self.parallel = resolve_layout(run, world).parallel
        accum = elastic.accumulation(dataclasses.replace(run, parallel=self.parallel), self.parallel.dp)
        self.optim_cfg = dataclasses.replace(self.optim_cfg, grad_accum=accum)

    def _replica_slice(self, indices: torch.Tensor) -> torch.Tensor:
        """This replica's part of a global batch, split further for gradient accumulation."""
        return Sampler.shard(indices, self.world.coords.dp, self.world.degrees.dp)

    def train_step(self, memory: StepMemory | None = None, trace: bool = False) -> dict:
        """One optimizer step: one global batch in `grad_accum` chunks per replica; returns a record.

        With `memory` (entered around the call), it is told when the gradients are reduced.
        `trace`: the last chunk's actions are timed (what `ProcessModel.replan` reads).
        """
        start = time.perf_counter()
        k = self.optim_cfg.grad_accum
        batch = self.sampler.next_global()
        indices = self._replica_slice(batch)
        chunks = indices.chunk(k)
        lr = lr_at(self.state.step, self.optim_cfg, self.cfg.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        scale = self.scaler.scale if self.scaler else 1.0  # fp16: see precision.py
        total = None  # stays on the device: no host synchronisation until the one read below
        for j, chunk in enumerate(chunks):
            x, y = _batch(self.train_data, chunk)
            loss = self.engine.forward_backward(x, y, loss_scale=scale / k, sync=j == k - 1,
                                                trace=trace and j == k - 1) / k
            total = loss if total is None else total + loss
        norm = self.engine.grad_norm() / scale
        loss_v, norm_v = torch.stack([total.float(), norm.to(total.device)]).tolist()  # the step's one read
        skipped = self.scaler is not None and self.scaler.skip(norm_v)
        if memory is not None:
            memory.grads_ready(self.engine.grads())
        if not skipped:
            self._check_finite(loss_v, norm_v)
            self._unscale_and_clip(norm, scale)
            self.optimizer.step()
            self.engine.after_optimizer_step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.cursor = self.sampler.cursor
        elapsed = time.perf_counter() - start
        first = x if torch.is_tensor(x) else structure.flatten(x, root="batch")[0][0]  # the ids
        tokens = self.cfg.batch_size * (first.shape[1] if first.dim() > 1 else 1)
        record = {"step": self.state.step, "loss": loss_v, "lr": lr, "grad_norm": norm_v,
                  "tokens_per_s": tokens / elapsed, "step_time_s": elapsed,
                  "samples": fingerprint(batch)}
        if self.utilization is not None:
            record.update(self.utilization.of(elapsed))
        if self.scaler is not None:
            record.update(loss_scale=scale, skipped=skipped)
        if self.experts:
            record.update(self.experts.record(self.engine.assembly.held, self.world.device))
        return record

    def _unscale_and_clip(self, norm: torch.Tensor, scale: float) -> None:
        """Divide out the loss scale and clip to --grad-clip, in one multiply, on the device.

        `norm` is the unscaled norm; the coefficient is computed as clip_grad_norm_ does
        (clamped on the device), so no value is read back to the host here.
        """
        coef = None
        if self.optim_cfg.grad_clip > 0:
            coef = torch.clamp(self.optim_cfg.grad_clip / (norm + 1e-6), max=1.0)
        if scale != 1.0:
            coef = 1.0 / scale if coef is None else coef / scale
        if coef is None:
            return
        for group in by_device(self.engine.grads()):
            torch._foreach_mul_(group, coef.to(group[0].device) if torch.is_tensor(coef) else coef)

    def _check_finite(self, loss: float, norm: float) -> None:
        """Refuse to step on a non-finite loss or gradient norm (clipping cannot mend it: the
        clip coefficient of a NaN norm is NaN, and min(1, NaN) is 1, so nothing is clipped).

        Both values are already reduced over every rank (loss over replicas and stages, norm over
        stages, gradients over replicas), so every rank raises at the same step: no rank is left
        waiting in a collective.

        Raises:
            NonFiniteError: before the optimizer step, so the parameters stay as they were.
        """
        for what, value in (("loss", loss), ("gradient norm", norm)):
            if not math.isfinite(value):
                self.optimizer.zero_grad(set_to_none=True)
                raise NonFiniteError(what, value, self.state.step + 1, self.optim_cfg.lr)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean validation loss over `eval_batches` fixed batches (the same every time)."""
        if self.val_data is None:
            return None
        self.model.eval()
        g = torch.Generator().manual_seed(12345)
        n = self.cfg.batch_size // self.world.degrees.dp
        total = 0.0
        for _ in range(self.cfg.eval_batches):
            idx = torch.randint(len(self.val_data), (self.cfg.batch_size,), generator=g)
            x, y = _batch(self.val_data, Sampler.shard(idx, self.world.coords.dp, self.world.degrees.dp)[:n])
            total += float(self.engine.evaluate(x, y))
        self.model.train()
        return total / self.cfg.eval_batches

    def fit(self) -> list[dict]:
        """Train until `max_steps`; returns the per-step records (on every process)."""
        self.model.train()
        if self.watchdog:
            self.watchdog.resume()
        try:
            with self.metrics:
                self._fit()
        finally:
            if self.watchdog:  # it judges fit() only: afterwards ranks may wait on each other freely
                self.watchdog.pause()
        return self.state.history

    def _fit(self) -> None:
        if self.state.step == 0 and self.val_data is not None:
            self._log({"step": 0, "val_loss": self.evaluate()})
        while self.state.step < self.cfg.max_steps and not self.stop_requested:
            forensics.doing(f"step {self.state.step + 1} begins")
            for hook in self.before_step:
                hook(self.state.step + 1)
            replan = self.replan_pending and self.steps_here >= 1 and self.state.step + 1 != self.memory_step
            record = self._measured_step() if self.state.step + 1 == self.memory_step else \
                self.train_step(trace=replan)
            self.steps_here += 1
            if replan:
                self._replan()
            if self.watchdog:
                self.watchdog.arm()  # warm-up is over: from now on the plain --hang-timeout
            self._log(record)
            step = self.state.step
            if self.val_data is not None and not self.stop_requested and (
                    step % self.cfg.eval_every == 0 or step == self.cfg.max_steps):
                self._log({"step": step, "val_loss": self.evaluate()})

    def _measured_step(self) -> dict:
        """`train_step` with this rank's memory measured (`memory.StepMemory`); every rank's goes
        to rank 0, which logs it as one `memory` event, `rank{r}/{kind}` in bytes."""
        with StepMemory(list(self.model.parameters()), self.optimizer, self.info.device) as mem:
            record = self.train_step(mem)
        c = self.world.coords
        mine = {**mem.report(), "dp_rank": c.dp, "pp_rank": c.pp, "cp_rank": c.cp, "tp_rank": c.tp}
        ranks: list = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        self.memory_report = ranks
        event = {"step": self.state.step, "event": "memory", "counted": mine["counted"]}
        for r, got in enumerate(ranks):
            event.update({f"rank{r}/{k}": got[k] for k in ("params", "grads", "optimizer", "activations",
                                                            "peak")})
        self._log(event)
        return record

    def _replan(self) -> None:
        """Plan the costed schedule again on the step just timed; log the costs as a `plan` event
        (`stage{s}/{forward,input,weight,backward}_s`)."""
        costs = self.engine.replan()
        self.replan_pending = False
        event = {"step": self.state.step, "event": "plan", "schedule": self.parallel.schedule}
        for s in range(len(costs.forward)):
            event.update({f"stage{s}/forward_s": costs.forward[s], f"stage{s}/input_s": costs.input_grad[s],
                          f"stage{s}/weight_s": costs.weight[s], f"stage{s}/backward_s": costs.whole(s)})
        self._log(event)

    def _log(self, record: dict) -> None:
        self.state.history.append(record)
        self.metrics.write(record)
        for cb in self.callbacks:
            cb(self, record)

    def close(self) -> None:
        if self.watchdog:
            self.watchdog.stop()
        self.engine.close()
