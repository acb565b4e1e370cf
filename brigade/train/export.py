"""`brigade export --hf OUT --from RUN`: a run's snapshot back into a Hugging Face directory.

The snapshot is layout-free (any dp, pp, shard, tp the run used reads back whole on one
process); each block's tensors are written under their directory names (`hf_names`: a
mixture's stacked experts as one tensor per expert, as transformers stores them), in the
dtype the original config.json names, a tied head's once (as save_pretrained does). Every other
file of the original directory (config.json, tokenizer, generation config) is copied as it is,
so `transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads the trained model.

OUT is written in a temporary folder beside it and renamed when complete: an export that fails
leaves nothing, and an existing OUT is never overwritten.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from brigade.errors import BrigadeError
from brigade.models import load_model
from brigade.models.hf.blocks import Stacked
from brigade.models.hf.deps import require
from brigade.models.hf.weights import INDEX, materialize
from brigade.parallel import lora
from brigade.parallel.assemble import OwnedBlocks
from brigade.snapshot.collective import load_model_only
from brigade.snapshot.format import resolve

WEIGHTS = ("*.safetensors", INDEX, "*.bin", "*.bin.index.json")


def trained_blocks(found) -> tuple[list[nn.Module], object]:
    """The blocks of an `hf:DIR` run's snapshot `found`, with its weights (one process), and the
    model spec's `HFModel`.

    Raises:
        BrigadeError: not an hf: run, or its directory is gone.
    """
    name = found.manifest.model
    if not name.startswith("hf:"):
        raise BrigadeError(f"{found.path} is a {name} run: export --hf needs a run of an hf:DIR model")
    if not Path(name[3:]).expanduser().is_dir():
        raise BrigadeError(f"{found.path} was trained from {name[3:]}, which is gone: its config and "
                           "tokenizer are needed; put the directory back where it was")
    spec = load_model(name, meta=True)
    owned = OwnedBlocks(spec.blocks, list(range(len(spec.blocks))))
    materialize(owned, "cpu")
    if (adapters := lora.from_config(found.manifest.config)) is not None:
        spec.hf.load(dict(enumerate(spec.blocks)), "cpu")  # the base, as the run read it
        lora.apply(spec.blocks, list(range(len(spec.blocks))), adapters)
    load_model_only(found.path, owned)
    return spec.blocks, spec.hf


def dtype_of(hf) -> torch.dtype:
    """The dtype the directory's config.json names (fp32 where it names none it could be)."""
    dtype = getattr(hf.config, "dtype", None) or getattr(hf.config, "torch_dtype", None)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def state_of(blocks: list[nn.Module], hf) -> dict[str, torch.Tensor]:
    """{directory name: tensor} of every block, a tied head left out, in the config's dtype."""
    dtype = dtype_of(hf)
    tied = set(hf.checkpoint.tied)
    out: dict[str, torch.Tensor] = {}
    for block in blocks:
        state = block.state_dict()
        for name, theirs in block.hf_names().items():
            if isinstance(theirs, Stacked):  # a mixture's experts: each expert's tensors apart
                for e, names in enumerate(theirs.parts):
                    for n, part in zip(names, state[name][e].chunk(len(names))):
                        out[n] = part.detach().to(dtype).contiguous()
            elif theirs not in tied:
                out[theirs] = state[name].detach().to(dtype).contiguous()
    return out


def export(source: str | Path, out: str | Path, adapter: bool = False) -> Path:
    """Write the newest good snapshot of `source` (a run folder, or a snapshot) to `out`: the
    whole model (a LoRA run's adapters merged into it), or with `adapter` a LoRA run's adapters
    alone as a PEFT adapter folder (`train.adapter_export`).

    Raises:
        BrigadeError: `out` exists, `source` holds no snapshot or not an hf: run; `adapter` for a
            run without --lora.
    """
    out = Path(out)
    if out.exists():
        raise BrigadeError(f"--hf {out} already exists: give a new directory (nothing was written)")
    found = resolve(source)
    blocks, hf = trained_blocks(found)
    if adapter:
        from brigade.train.adapter_export import write_adapter

        adapters = lora.from_config(found.manifest.config)
        if adapters is None:
            raise BrigadeError(f"--adapter: {found.path} trained every weight (no --lora): export the "
                               "whole model, without --adapter")
        return _written(out, lambda tmp: write_adapter(blocks, hf, adapters, tmp, dtype_of(hf)))
    lora.merge(blocks)  # a LoRA run's adapters folded into the weights they adapt
    safetensors = require("safetensors.torch")

    def write(tmp: Path) -> None:
        skip = {p for pattern in WEIGHTS for p in hf.directory.glob(pattern)}
        for f in sorted(hf.directory.iterdir()):
            if f.is_file() and f not in skip:
                shutil.copy2(f, tmp / f.name)
        safetensors.save_file(state_of(blocks, hf), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return _written(out, write)


def _written(out: Path, write) -> Path:
    """`write(tmp)` into a temporary folder beside `out`, renamed `out` once complete; nothing
    left behind where it fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write(tmp)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
