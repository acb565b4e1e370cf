"""Restoring a whole training state across all ranks, and what writing and reading share.

Writing is `writer.py` (at once or in the background) and its last act `commit.py`. What a
snapshot holds: model and optimizer state (DCP, layout-free names), the
step and the data cursor (from which the epoch follows), the LR schedule (a
pure function of the step), each rank's RNG states, fp16's loss scale, a hash of the
configuration, and the run's extra metadata (e.g. the vocabulary). The folders and
the manifest are `format.py`'s. A shared parameter is stored once, under its canonical
name, with its optimizer state (`ties.py`).

No pickle from disk is trusted: DCP's metadata goes through an unpickler that only
admits DCP's own metadata classes, and tensors load with `weights_only=True`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import re
import warnings
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from brigade.dtensors import full
from brigade.snapshot.format import (
    Manifest,
    Snapshot,
    SnapshotError,
    params_sha256,
    tensor_sha256,
)
from brigade.snapshot.rng import set_rng_state
from brigade.snapshot.ties import aliases_of, filled, to_load

# Optimizer state keyed per parameter name ("state.blocks.3.w.exp_avg", "param_groups.blocks.3.w.lr"),
# not by group index: stages hold different groups, and keys must not collide across ranks.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# A model with frozen weights (--lora) stores only what trains: the frozen base is rebuilt as
# the run first built it (its seed, its hf:DIR directory), so a snapshot is the adapters' size.
# Not strict: the model's frozen keys are missing from what is loaded by design; DCP's load
# still fails on any key of what trains that the snapshot lacks.
FROZEN_LEFT_OUT = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True,
                                   strict=False)


def options(model: nn.Module) -> StateDictOptions:
    """How `model`'s state is read and written: `FROZEN_LEFT_OUT` where some weight is frozen."""
    return OPTIONS if all(p.requires_grad for p in model.parameters()) else FROZEN_LEFT_OUT


def state_dicts(model: nn.Module, optimizer) -> tuple[dict, dict]:
    """DCP's (model, optimizer) state dicts of `model` by `options(model)`; where frozen weights
    are left out, so is every other name of one (a tied head's, which DCP keeps)."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options(model))
    if options(model) is FROZEN_LEFT_OUT:
        trains = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        model_sd = {k: v for k, v in model_sd.items() if k in trains}
    return model_sd, optim_sd


def stored_params(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of what a snapshot of `model` holds, aliases of a tie included: every
    parameter, or, where some are frozen (`options`), those that train."""
    frozen_left_out = options(model) is FROZEN_LEFT_OUT
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad or not frozen_left_out]


class LossScale(Protocol):
    """fp16's loss scaler (`brigade.train.precision.LossScaler`) as a snapshot sees it."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class _MetadataUnpickler(pickle.Unpickler):
    """Admit only the classes DCP puts in its `.metadata` file."""

    def find_class(self, module: str, name: str):
        allowed = (
            module.startswith("torch.distributed.checkpoint.")
            or (module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None),
                                                                   (torch.dtype, torch.layout,
                                                                    torch.memory_format))))
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath"))
            or (module == "collections" and name == "OrderedDict")
        )
        if not allowed:
            raise SnapshotError(f"snapshot metadata refers to {module}.{name}, which a snapshot never "
                                "contains: the file is not a brigade snapshot; refusing to load it")
        return super().find_class(module, name)


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, loading `.metadata` through `_MetadataUnpickler`."""

    def read_metadata(self):
        path = Path(self.path) / ".metadata"
        with open(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except SnapshotError:
                raise
            except Exception as exc:
                raise SnapshotError(f"{path} is unreadable ({type(exc).__name__}): the snapshot is damaged")\
                    from None
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata




def _param_hashes(model: nn.Module) -> dict[str, str]:
    """Every stored parameter's hash (`stored_params`) over all ranks, a shared one once (its
    canonical name); a sharded one of the whole parameter, gathered (so every layout hashes the
    same model alike)."""
    tied = aliases_of(model)
    mine = {name: tensor_sha256(full(p)) for name, p in stored_params(model) if name not in tied}
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        for part in parts:
            mine.update(part)
    return mine


def model_params_sha256(model: nn.Module) -> str:
    return params_sha256(_param_hashes(model))


def collective_device() -> torch.device:
    """Where the default group's tensors must live: NCCL takes only CUDA tensors, on the
    device this process was bound to (`torch.cuda.set_device` in `brigade.launcher.groups.init`)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def devices_of(model: nn.Module) -> list[torch.device]:
    """The devices this process computes on, in stage order: whose RNG states it owns."""
    seen: dict[torch.device, None] = {}
    for p in model.parameters():
        seen.setdefault(p.device, None)
    return list(seen)


@contextlib.contextmanager
def _quiet_dcp():
    """DCP logs its own tracebacks when a load fails (some on the root logger); the error we raise
    says it in one line."""
    loggers = [logging.getLogger(), logging.getLogger("torch.distributed.checkpoint")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def first_line(exc: BaseException) -> str:
    text = str(exc)
    refused = re.search(r"snapshot metadata refers to [^\n]*refusing to load it", text)
    if refused:
        return refused[0]
    lines = [ln for ln in text.splitlines() if ln.strip()]
    useful = [ln for ln in lines if "Error" in ln and "Traceback" not in ln]
    return (useful or lines or [type(exc).__name__])[-1].strip()[:300]


def load(snapshot: Snapshot, model: nn.Module, optimizer,
         loss_scaler: LossScale | None = None) -> Manifest:
    """Restore model, optimizer, this rank's RNG and fp16's loss scale from a verified snapshot.

    Args:
        loss_scaler: fp16's scaler, given the saved scale if the snapshot has one.
    Returns:
        the snapshot's manifest.
    Raises:
        SnapshotError: DCP cannot load it into this model (one line).
    """
    model_sd, optim_sd = state_dicts(model, optimizer)
    tied = aliases_of(model)
    (model_read, model_fill), (optim_read, optim_fill) = to_load(model_sd, tied), to_load(optim_sd, tied)
    state = {"model": model_read, "optim": optim_read}
    try:
        with _quiet_dcp():
            dcp.load(state, storage_reader=SafeReader(snapshot.path))
    except SnapshotError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP's own error is a BaseException
        raise SnapshotError(f"{snapshot.path}: {first_line(exc)}") from None
    set_state_dict(model, optimizer, model_state_dict=filled(state["model"], model_fill),
                   optim_state_dict=filled(state["optim"], optim_fill), options=options(model))
    rng_file = snapshot.path / f"rng_{dist.get_rank() if dist.is_initialized() else 0}.json"
    if rng_file.is_file():
        set_rng_state(json.loads(rng_file.read_text()), devices_of(model))
    if loss_scaler is not None and snapshot.manifest.loss_scale is not None:
        loss_scaler.load_state_dict(snapshot.manifest.loss_scale)
    return snapshot.manifest


def load_model_only(path: Path, model: nn.Module) -> None:
    """Single process, no optimizer: for `generate` and `inspect`. A model with frozen weights
    (--lora) reads only what trains; the rest it has already (`options`)."""
    state_dict = model.state_dict()
    if options(model) is FROZEN_LEFT_OUT:
        trains = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        state_dict = {k: v for k, v in state_dict.items() if k in trains}
    read, fill = to_load(state_dict, aliases_of(model))
    state = {"model": read}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            with _quiet_dcp():
                dcp.load(state, storage_reader=SafeReader(path), no_dist=True)
        except SnapshotError:
            raise
        except (Exception, CheckpointException) as exc:
            raise SnapshotError(f"{path}: {first_line(exc)}") from None
    model.load_state_dict(filled(state["model"], fill), strict=options(model).strict)

