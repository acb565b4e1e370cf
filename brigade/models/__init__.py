"""Model registry: built-in names and ``path/to/file.py:factory``.

Every model is a `ModelSpec`: an ordered list of blocks, the loss applied to the
last block's output, and a way to make a synthetic batch (for check, bench, tune).

A user's file may define, beside its factory:
    batch(batch_size: int, generator: torch.Generator) -> (inputs, targets)
    loss(output, targets) -> scalar mean over the batch
    recompute = {block index: "none" | "full" | "selective"}   per block, over --recompute
    tp_plan = {block index: {submodule: "colwise" | "rowwise"}}  how --tp splits each block
(the last two are the same as giving those blocks a `recompute` / `tp_plan` attribute; see
brigade.parallel.tensor for plans)
Without them, brigade infers an input from the first Linear / Conv2d / Embedding
and uses mean-squared error against random targets (as the tutorial does).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from brigade.errors import BrigadeError
from brigade.models.documents import random_documents
from brigade.models.gpt import GPTConfig, gpt, gpt_loss
from brigade.models.resnet import resnet50
from brigade.models.spec import Batch, ModelSpec
from brigade.models.toy import mlp, toy

BUILTIN = ("gpt", "resnet50", "toy", "mlp")


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _gpt(gpt_cfg: GPTConfig | None, documents: bool = False, **_) -> ModelSpec:
    """`documents`: the blocks take packed rows' documents, and the batches pack a few each
    (`models.documents`)."""
    cfg = gpt_cfg or GPTConfig()
    if documents:
        cfg = dataclasses.replace(cfg, documents=True)

    def make_batch(n: int, g: torch.Generator) -> Batch:
        seq = torch.randint(cfg.vocab_size, (n, cfg.block_size + 1), generator=g)
        if cfg.documents:
            return {"idx": seq[:, :-1], "documents": random_documents(n, cfg.block_size, g)}, seq[:, 1:]
        return seq[:, :-1], seq[:, 1:]

    return ModelSpec("gpt", gpt(cfg), gpt_loss, make_batch)


def _resnet(image_size: int = 64, **_) -> ModelSpec:
    def make_batch(n: int, g: torch.Generator) -> Batch:
        x = torch.randn(n, 3, image_size, image_size, generator=g)
        return x, torch.randint(1000, (n,), generator=g)

    return ModelSpec("resnet50", resnet50(), F.cross_entropy, make_batch)


def _randn_pair(d_in: int, d_out: int) -> Callable[[int, torch.Generator], Batch]:
    def make_batch(n: int, g: torch.Generator) -> Batch:
        return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)

    return make_batch


def _toy(**_) -> ModelSpec:
    return ModelSpec("toy", toy(), _mse, _randn_pair(10, 5))


def _mlp(width: int = 1024, depth: int = 8, **_) -> ModelSpec:
    return ModelSpec("mlp", mlp(width, depth), _mse, _randn_pair(width, width))


def load_model(name: str, seed: int = 0, **options) -> ModelSpec:
    """Build a model by built-in name or ``FILE:FACTORY``, with weights drawn from `seed`.

    Options: gpt_cfg (GPTConfig) for gpt, image_size for resnet50, width/depth for mlp; for
    hf:DIR, those of `models.hf.model.load_hf` (meta, dropout, block_size); documents (gpt,
    hf:DIR): blocks that take packed rows' documents, and batches that pack a few a row.

    Raises:
        BrigadeError: unknown name, missing file or factory, factory failure, or a non-block result.
    """
    torch.manual_seed(seed)
    if name.startswith("hf:"):
        from brigade.models.hf.model import load_hf  # the optional extra, only when named

        return load_hf(name, seed=seed, **options)
    builders = {"gpt": _gpt, "resnet50": _resnet, "toy": _toy, "mlp": _mlp}
    if name in builders:
        return builders[name](**options)
    if ":" not in name:
        raise BrigadeError(
            f"unknown model {name!r}: expected one of {', '.join(BUILTIN)}, path/to/file.py:factory "
            "or hf:DIR (a Hugging Face directory)"
        )
    return _from_file(name, **options)


def _import_file(path: Path):
    spec = importlib.util.spec_from_file_location(f"brigade_user_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's file: any error is theirs to see, in one line
        raise BrigadeError(f"model file {path} failed to import: {type(exc).__name__}: {exc}") from None
    return module


def _from_file(spec_text: str, **text) -> ModelSpec:
    """A user's `FILE:FACTORY`; `text` (vocab_size, when training on a text) goes to the factory
    where its signature names it."""
    file_part, _, factory_name = spec_text.rpartition(":")
    path = Path(file_part)
    if not path.is_file():
        raise BrigadeError(f"model file {file_part!r} not found: give path/to/file.py:factory")
    module = _import_file(path)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        names = sorted(n for n in vars(module) if callable(getattr(module, n)) and not n.startswith("_"))
        raise BrigadeError(
            f"{path} has no factory {factory_name!r}: define it, or pick one of "
            f"{', '.join(names) or '(none)'}"
        )
    takes = inspect.signature(factory).parameters
    try:
        made = factory(**{k: v for k, v in text.items() if k in takes})
    except Exception as exc:
        raise BrigadeError(f"factory {spec_text} raised {type(exc).__name__}: {exc}") from None
    blocks = as_blocks(made, spec_text)
    _declare_recompute(blocks, getattr(module, "recompute", None), path)
    _declare(blocks, getattr(module, "tp_plan", None), path, "tp_plan", "{1: {'fc': 'colwise'}}",
             "plan")
    loss_fn = getattr(module, "loss", _mse)
    make_batch = getattr(module, "batch", None) or _infer_batch(blocks)
    return ModelSpec(spec_text, blocks, loss_fn, make_batch, getattr(module, "text_inputs", None))


def _declare_recompute(blocks: list[nn.Module], plan: object, path: Path) -> None:
    """A model file's `recompute = {index: mode}`: each named block declares its mode (the modes
    themselves are checked where recompute is applied, `brigade.parallel.recompute`)."""
    _declare(blocks, plan, path, "recompute", "{0: 'none', 3: 'full'}", "mode")


def _declare(blocks: list[nn.Module], table: object, path: Path, name: str, example: str, what: str) -> None:
    """A model file's per-block table `name = {index: value}`: each named block gets the attribute
    `name` (checked where it is used: recompute's modes, tensor parallel's plans).

    Raises:
        BrigadeError: not a dict, or it names a block the model does not have.
    """
    if table is None:
        return
    if not isinstance(table, dict):
        raise BrigadeError(f"{path}: {name} is a {type(table).__name__}: expected a dict like "
                           f"{example} from block index to {what}")
    for i, value in table.items():
        if not isinstance(i, int) or not 0 <= i < len(blocks):
            raise BrigadeError(f"{path}: {name} names block {i!r} but the model has {len(blocks)} "
                               f"blocks (0 to {len(blocks) - 1}): name blocks by their index")
        setattr(blocks[i], name, value)


def as_blocks(made: object, where: str = "model") -> list[nn.Module]:
    """An nn.Sequential or a list/tuple of modules → list of blocks.

    Raises:
        BrigadeError: for anything else, or an empty list.
    """
    if isinstance(made, nn.Sequential):
        blocks = list(made)
    elif isinstance(made, (list, tuple)) and all(isinstance(b, nn.Module) for b in made):
        blocks = list(made)
    else:
        raise BrigadeError(
            f"{where} returned {type(made).__name__}: expected an nn.Sequential or a list of nn.Module blocks"
        )
    if not blocks:
        raise BrigadeError(f"{where} returned no blocks: expected at least one nn.Module")
    return blocks


def _infer_batch(blocks: list[nn.Module]) -> Callable[[int, torch.Generator], Batch]:
    first = next(
        (m for b in blocks for m in b.modules() if isinstance(m, (nn.Linear, nn.Conv2d, nn.Embedding))),
        None,
    )
    if first is None:
        raise BrigadeError(
            "cannot infer the model's input: define batch(batch_size, generator) -> (inputs, targets) "
            "in the model file"
        )

    def make_input(n: int, g: torch.Generator) -> torch.Tensor:
        if isinstance(first, nn.Linear):
            return torch.randn(n, first.in_features, generator=g)
        if isinstance(first, nn.Conv2d):
            return torch.randn(n, first.in_channels, 32, 32, generator=g)
        return torch.randint(first.num_embeddings, (n, 16), generator=g)

    def make_batch(n: int, g: torch.Generator) -> Batch:
        x = make_input(n, g)
        model = nn.Sequential(*blocks)
        was_training = model.training
        model.eval()  # leave BatchNorm statistics untouched
        try:
            y = _chain_output(blocks, x[:1])
        finally:
            model.train(was_training)
        return x, torch.randn((n, *y.shape[1:]), generator=g)

    return make_batch


def _chain_output(blocks: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """The last block's output for the inferred input `x`, block by block, so that a misfit names
    its block. (Models know nothing of pipelines: the stage-by-stage checks of structures and side
    inputs are `pipeline.stages.partition.check_chain`'s, which every command runs before any work.)

    Raises:
        BrigadeError: a block that cannot take its predecessor's output, or one whose output is
            not one tensor (an inferred batch is one tensor through the chain; a model that
            passes structures defines its own batch() and loss()).
    """
    h = x
    with torch.no_grad():
        for i, block in enumerate(blocks):
            try:
                h = block(h)
            except Exception as exc:  # the user's block: their error, in one line
                raise BrigadeError(f"{_misfit(blocks, i, h)}: {type(exc).__name__}: {exc}: fix the model "
                                   "file's blocks, or define batch(batch_size, generator) there") from None
    if not isinstance(h, torch.Tensor):
        raise BrigadeError(f"block {len(blocks) - 1} ({type(blocks[-1]).__name__}) returns a structure: "
                           "define batch() and loss() in the model file")
    return h


def _misfit(blocks: list[nn.Module], i: int, h: object) -> str:
    """'block 0 (Linear) outputs shape (1, 7), which block 1 (Linear) cannot take', as check_chain says it."""
    name = f"block {i} ({type(blocks[i]).__name__})"
    if i == 0:
        return f"{name} cannot take an input inferred from its first layer"
    out = f"shape {tuple(h.shape)}" if isinstance(h, torch.Tensor) else f"a {type(h).__name__}"
    return f"block {i - 1} ({type(blocks[i - 1]).__name__}) outputs {out}, which {name} cannot take"
