"""A directory's safetensors weights, read tensor by tensor into the blocks a rank holds.

    Checkpoint(DIR)            which file holds each tensor (model.safetensors, or the shards
                               model.safetensors.index.json lists), opened lazily
    load_blocks(blocks, ckpt)  every parameter and persistent buffer of the given blocks, read
                               under its directory name; a DTensor (tensor parallel, FSDP2,
                               expert parallel) reads only its own part, a slice of the stored
                               tensor; a mixture's stacked experts (`blocks.Stacked`) read
                               expert by expert, only this process's experts' rows

A rank calls `load_blocks` on its own blocks only, after tensor parallel and sharding have
placed them: it never reads, let alone holds, the rest of the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from brigade.errors import BrigadeError
from brigade.models.hf.blocks import Stacked
from brigade.models.hf.deps import require

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


def has_weights(directory: str | Path) -> bool:
    """Whether `directory` holds safetensors weights (model.safetensors or an index of shards)."""
    return (Path(directory) / INDEX).is_file() or (Path(directory) / SINGLE).is_file()


class Checkpoint:
    """The tensors of a `save_pretrained` directory, by name.

    Args:
        directory: the directory; `tied` maps a name the file may leave out (a tied head's
            "lm_head.weight") to the name it shares its values with.

    Raises:
        BrigadeError: no model.safetensors nor index, an index naming a file that is not there.
    """

    def __init__(self, directory: str | Path, tied: dict[str, str] | None = None):
        self.directory = Path(directory)
        self.tied = dict(tied or {})
        self._open: dict[str, object] = {}
        if (self.directory / INDEX).is_file():
            self.files = dict(json.loads((self.directory / INDEX).read_text())["weight_map"])
        elif (self.directory / SINGLE).is_file():
            self.files = {name: SINGLE for name in self._handle(SINGLE).keys()}
        else:
            bins = sorted(p.name for p in self.directory.glob("*.bin"))
            hint = (f" (it has {bins[0]}: load it with transformers and save_pretrained it again, which "
                    "writes safetensors)") if bins else ""
            raise BrigadeError(f"{self.directory} has no weights: expected {SINGLE} or {INDEX}, as "
                               f"save_pretrained writes them{hint}")
        for file in sorted(set(self.files.values())):
            if not (self.directory / file).is_file():
                raise BrigadeError(f"{self.directory / INDEX} names {file}, which is not in the "
                                   "directory: copy every shard the index lists")

    def _handle(self, file: str):
        """The open safetensors file (memory-mapped: nothing read until a tensor is).

        Raises:
            BrigadeError: a file that cannot be mapped (larger than the memory the machine lets a
                process map) or whose header is cut short or broken (a truncated download).
        """
        if file not in self._open:
            safetensors = require("safetensors")
            path = self.directory / file
            try:
                self._open[file] = safetensors.safe_open(str(path), framework="pt")
            except Exception as exc:  # noqa: BLE001 -- safetensors' own error, or the mmap's RuntimeError
                raise BrigadeError(_unreadable(path, exc)) from None
        return self._open[file]

    def stored_as(self, name: str) -> str:
        """The name `name`'s values are stored under (itself, or the tensor a tied one shares).

        Raises:
            BrigadeError: the directory has neither.
        """
        if name in self.files:
            return name
        if name in self.tied and self.tied[name] in self.files:
            return self.tied[name]
        raise BrigadeError(f"{self.directory}: the weights have no tensor {name!r}, which the model "
                           "config.json describes needs: the weights and config.json do not match")

    def shape(self, name: str) -> tuple[int, ...]:
        stored = self.stored_as(name)
        return tuple(self._handle(self.files[stored]).get_slice(stored).get_shape())

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor `name`, or only the part `index` selects (read without loading the rest)."""
        stored = self.stored_as(name)
        part = self._handle(self.files[stored]).get_slice(stored)
        return part[index] if index else part[:]


def _unreadable(path: Path, exc: Exception) -> str:
    """The one line for a weight file safetensors cannot open."""
    size = path.stat().st_size / 1e9
    if "mmap" in str(exc) or "Cannot allocate memory" in str(exc):
        return (f"{path} ({size:.1f} GB) cannot be mapped into memory ({exc}): this machine lets a "
                "process map less; write the weights as shards of a few GB (save_pretrained(..., "
                "max_shard_size='5GB') writes them with model.safetensors.index.json)")
    return (f"{path} ({size:.1f} GB) is not a whole safetensors file ({exc}): a download cut "
            "short? copy it again, or write it again with save_pretrained")


def _part(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...] | None]:
    """Where `t`'s values live here and which slice of the whole tensor they are (None: all).

    A DTensor whose placements cut the whole tensor into one box per process (Shard, Replicate)
    reads its box; any other placement (FSDP2 over a tensor-parallel shard: a strided shard)
    reads the whole tensor and keeps its part (`distribute_tensor` computes it locally)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(t, DTensor):
        return t, None
    if all(type(p) in (Shard, Replicate) for p in t.placements):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))
    return t.to_local(), ()


def _strided_part(t, whole: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole, t.device_mesh, t.placements, src_data_rank=None).to_local()


def check_blocks(blocks: list[nn.Module], ckpt: Checkpoint) -> None:
    """Every tensor the blocks need is in the directory with the blocks' shape, read from the
    files' headers alone (before any process starts: a run that cannot load is refused whole).

    Raises:
        BrigadeError: as `fill`.
    """
    for block in blocks:
        tensors = _tensors(block)
        for name, hf in block.hf_names().items():
            if isinstance(hf, Stacked):
                _stacked_shapes(ckpt, hf, tuple(tensors[name].shape))
            else:
                _same_shape(ckpt, hf, tuple(tensors[name].shape))


def _tensors(block: nn.Module) -> dict[str, torch.Tensor]:
    """A block's parameters and buffers by name (what its `hf_names` name)."""
    return {**dict(block.named_parameters()), **dict(block.named_buffers())}


def _same_shape(ckpt: Checkpoint, name: str, shape: tuple[int, ...]) -> None:
    stored = ckpt.shape(name)
    if stored != shape:
        raise BrigadeError(f"{ckpt.directory}: tensor {name!r} is stored with shape {list(stored)} but "
                           f"config.json makes it {list(shape)}: the weights and config.json do "
                           "not match")


def _stacked_shapes(ckpt: Checkpoint, stacked: Stacked, shape: tuple[int, ...]) -> None:
    """Each expert's tensors of `stacked` are there, and stack to `shape` (E, rows, columns): E
    experts, their parts' rows adding up, each part of `columns`.

    Raises:
        BrigadeError: a missing tensor (`stored_as`), or one whose shape does not stack so.
    """
    experts, rows, columns = shape
    each = rows // len(stacked.parts[0])
    for names in stacked.parts:
        for name in names:
            _same_shape(ckpt, name, (each, columns))
    if len(stacked.parts) != experts:
        raise BrigadeError(f"{ckpt.directory}: {len(stacked.parts)} experts' tensors for {stacked} but "
                           f"config.json makes {experts}: the weights and config.json do not match")


@torch.no_grad()
def fill_stacked(t: torch.Tensor, ckpt: Checkpoint, stacked: Stacked) -> None:
    """Copy the experts of `stacked` into `t` (this process's part of it: its experts' rows and
    columns only, each expert's parts read one at a time).

    Raises:
        BrigadeError: as `check_blocks`.
    """
    _stacked_shapes(ckpt, stacked, tuple(t.shape))
    dst, index = _part(t)
    if index == ():  # a placement that is not one box: the whole, then this process's part
        whole = torch.stack([torch.cat([ckpt.read(n) for n in names]) for names in stacked.parts])
        dst.copy_(_strided_part(t, whole.to(dst.dtype)))
        return
    experts, rows, columns = index or (slice(None),) * 3
    for k, names in enumerate(stacked.parts[experts]):
        expert = torch.cat([ckpt.read(n, (slice(None), columns)) for n in names])
        dst[k].copy_(expert[rows])


@torch.no_grad()
def fill(t: torch.Tensor, ckpt: Checkpoint, name: str) -> None:
    """Copy the directory's `name` into `t` (this process's part of it, for a DTensor).

    Raises:
        BrigadeError: the tensor is missing, or its stored shape is not the model's.
    """
    _same_shape(ckpt, name, tuple(t.shape))
    dst, index = _part(t)
    if index == ():
        dst.copy_(_strided_part(t, ckpt.read(name)))
    elif dst.numel():
        dst.copy_(ckpt.read(name, index))


def load_blocks(blocks: dict[int, nn.Module], ckpt: Checkpoint) -> None:
    """Every parameter and persistent buffer of `blocks` ({index: block}, each with `hf_names`)
    from the directory, in place.

    Raises:
        BrigadeError: as `fill`.
    """
    for block in blocks.values():
        tensors = _tensors(block)
        for name, hf in block.hf_names().items():
            (fill_stacked if isinstance(hf, Stacked) else fill)(tensors[name], ckpt, hf)


def materialize(module: nn.Module, device: torch.device | str) -> None:
    """Give every meta parameter and buffer of `module` real (uninitialized) memory on `device`,
    in place, keeping one parameter shared by several submodules shared (`to_empty` would not:
    a tied embedding and head would become two parameters). A buffer no checkpoint holds (not
    persistent: a mixture's balancing bias) starts at zero, not at whatever the memory held."""
    made: dict[int, torch.Tensor] = {}
    for sub in module.modules():
        for key, p in list(sub._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
                sub._parameters[key] = made[id(p)]
        for key, b in list(sub._buffers.items()):
            if b is not None and b.is_meta:
                fresh = torch.zeros_like if key in sub._non_persistent_buffers_set else torch.empty_like
                sub._buffers[key] = made.setdefault(id(b), fresh(b, device=device))
