"""From a batch to what each rank's runner takes: main input, side inputs, targets, weights.

A batch's inputs may be a tensor or a structure; when the model's blocks declare side inputs
(`side_inputs.StageModule`), the inputs are a dict and the declared keys are taken out
(`side_inputs.split_named`). Everything is micro-batched along dim 0 (`microbatch.split_structure`)
and moved to the device of the stage that reads it:

    inputs ─split_named─► main  ─split─► stage 0's rank
                          side  ─split─► per micro-batch {name: value}, to each rank whose
                                         stages declare the name (from the data on that rank)
    targets ─split─► the last stage's rank; weights: each micro-batch's share of the batch

Under context parallel (`parts`: `parallel.context.ContextParallel`, which this module only
calls) every micro-batch's tensors of two or more dimensions are then cut to this process's part
of the sequence (`parts.cut`, along dimension 1), and each micro-batch's weight takes the part's
share of its counted targets (`parts.share`, from the whole targets).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from brigade.errors import BrigadeError
from brigade.pipeline.batches import microbatch
from brigade.pipeline.stages import side_inputs, structure


def _inner(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, DistributedDataParallel) else module


def declarations(modules: Mapping[int, nn.Module]) -> dict[str, str]:
    """{side input name: "stage s: block i (Type)"} for the first block of these stages that
    declares it (only `StageModule` stages declare side inputs)."""
    out: dict[str, str] = {}
    for s, module in sorted(modules.items()):
        m = _inner(module)
        if isinstance(m, side_inputs.StageModule):
            for i, block, names in zip(m.indices, m.blocks(), m.wants):
                for name in names:
                    out.setdefault(name, f"stage {s}: block {i} ({type(block).__name__})")
    return out


def merge(parts: list[dict[str, str]]) -> dict[str, str]:
    """Several ranks' `declarations` as one, the earliest stage first."""
    out: dict[str, str] = {}
    for part in parts:
        for name, label in part.items():
            if name not in out or _stage(label) < _stage(out[name]):
                out[name] = label
    return out


def _stage(label: str) -> int:
    return int(label.split(":")[0].removeprefix("stage "))


def to(obj: Any, device: torch.device) -> Any:
    """A tensor or structure with its tensors on `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    tensors, spec = structure.flatten(obj, root="input")
    return structure.unflatten([t.to(device) for t in tensors], spec)


class Feed:
    """Turns one batch into the runners' arguments, for the stages of one pipeline.

    Args:
        modules: {stage: module} whose side inputs are to be delivered (all of a LocalPipeline's,
            or this rank's).
        declared: every side input the model declares → "stage s: block i (Type)" (`declarations`
            over all stages), to separate the main input on the first rank.
        first_label: how messages name the first block's input (e.g. "stage 0: block 0 (Embed)").
        parts: context parallel's cut of each micro-batch (module docstring); None: whole.
    """

    def __init__(self, modules: Mapping[int, nn.Module], declared: dict[str, str], first_label: str,
                 parts=None):
        self.declared, self.parts = declared, parts
        self.first_label = first_label
        self.wants = {s: _inner(m).side_inputs for s, m in modules.items()
                      if isinstance(_inner(m), side_inputs.StageModule)}

    def main(self, inputs: Any) -> tuple[Any, dict[str, Any]]:
        """(main input, {declared name: value}) of a batch's inputs.

        Raises:
            BrigadeError: a declared side input missing from the batch, or undeclared keys.
        """
        return side_inputs.split_named(inputs, self.declared) if self.declared else (inputs, {})

    def split(self, obj: Any, m: int, root: str, device: torch.device,
              batch_size: int | None = None) -> list[Any]:
        """Micro-batches of a tensor or structure, on `device` (this process's part of each under
        context parallel)."""
        return [to(self._cut(x), device) for x in microbatch.split_structure(obj, m, batch_size, root)]

    def _cut(self, obj: Any) -> Any:
        if self.parts is None:
            return obj
        if isinstance(obj, torch.Tensor):
            return self.parts.cut(obj)
        tensors, spec = structure.flatten(obj, root="input")
        return structure.unflatten([self.parts.cut(t) for t in tensors], spec)

    def inputs(self, inputs: Any, m: int, device: torch.device) -> list[Any]:
        """The main input's micro-batches for stage 0."""
        main, _ = self.main(inputs)
        return self.split(main, m, f"{self.first_label}'s input", device)

    def side(self, inputs: Any, m: int, stages: list[int], device: torch.device) -> list[dict] | None:
        """Per micro-batch, {name: value} for the side inputs `stages` take (None: they take none).

        Raises:
            BrigadeError: no inputs given to a rank whose stages take side inputs, a side input
                missing from the batch, or one whose dim 0 is not the batch size.
        """
        names = list(dict.fromkeys(n for s in stages for n in self.wants.get(s, ())))
        if not names:
            return None
        if inputs is None:
            raise BrigadeError(f"{self.declared[names[0]]} takes side input {names[0]!r} but this rank "
                               "got no inputs: pass the batch's inputs on every rank of the pipeline")
        main, values = self.main(inputs)
        batch = microbatch.batch_size_of(main, f"{self.first_label}'s input")
        out: list[dict] = [{} for _ in range(m)]
        for name in names:
            root = f"{self.declared[name]}'s side input {name!r}"
            for mb, value in zip(out, self.split(values[name], m, root, device, batch)):
                mb[name] = value
        return out

    def targets(self, targets: Any, m: int, device: torch.device, loss_scale: float = 1.0
                ) -> tuple[list[Any], list[float]]:
        """The targets' micro-batches and each micro-batch's weight (share of the batch × scale)."""
        if targets is None:
            raise BrigadeError("targets=None on the rank of the last stage: pass the batch's targets")
        n = microbatch.batch_size_of(targets, "targets")
        weights = [w * loss_scale for w in microbatch.weights(n, m)]
        if self.parts is not None:  # each part's share of its micro-batch's counted targets
            whole = microbatch.split_structure(targets, m, n, "targets")
            weights = [w * self.parts.share(y) for w, y in zip(weights, whole)]
        return self.split(targets, m, "targets", device, n), weights


def first_label(module: nn.Module | None) -> str:
    """How messages name stage 0's first block (its input is the batch's main input)."""
    m = _inner(module) if module is not None else None
    if isinstance(m, side_inputs.StageModule) and m.indices:
        return f"stage 0: block {m.indices[0]} ({type(m.blocks()[0]).__name__})"
    return "stage 0"
