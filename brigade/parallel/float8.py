"""Float8 training through torchao: the body's linear layers compute their matmuls in float8.

`--float8 tensorwise|rowwise` swaps each eligible `nn.Linear` of the model's body for torchao's
`Float8Linear` (`convert_to_float8_training`), whose forward and backward cast the input, the
weight and the output's gradient to float8 with a dynamic scale and multiply with
`torch._scaled_mm`; the parameters stay fp32 (the master weights AdamW updates), so nothing else
of the run changes: names, optimizer state and snapshots are those of the unconverted model.

    tensorwise   one scale per tensor: e4m3 input and weight, e5m2 gradients; the fastest kernels
    rowwise      one scale per row (power-of-two scales), e4m3 throughout; more accurate

Which layers (`convert`, its one-line `Conversion.line`):
    the body only   blocks 1 .. n-2 of [first, body..., last]: the first block reads the model's
                    raw input and the last makes what the loss reads (a GPT's output head), both
                    kept in full precision, as torchtitan keeps its output layer
    shapes          a layer whose in or out features are not multiples of 16 is kept: the GPU's
                    float8 kernels refuse it (torch._scaled_mm); the same rule on every device,
                    so what a CPU check converts is what the GPU run converts
    shared weights  a layer whose weight another layer also holds (a tie) is kept: the swap
                    would give one of them a weight of its own

Where the converted stage is sharded (FSDP2) with the tensorwise recipe, each weight is
all-gathered in float8 (a quarter of fp32's bytes): the weight is wrapped so that FSDP casts
its shard, with a scale from the whole weight, before the all-gather. Rowwise scales cannot be
gathered that way (torchao refuses it), so its weights are gathered as FSDP's mixed precision
says. With float8 all-gather the scales may be computed once per step for every weight, in one
all-reduce, by `refresh_scales` after the optimizer step (see there for exactly when).

Order (the assembler's): float8 first, before tensor parallel, recompute, compile and sharding.
The conversion replaces modules, so it must come before anything that hooks them (tensor
parallel's input and output hooks live on the very `nn.Linear` it would replace) or wraps their
weights (tensor parallel's DTensors, FSDP2's shards); `convert` refuses a weight that is already
a DTensor. Tensor parallel then splits a `Float8Linear` as it splits an `nn.Linear` (it is one),
with torch's own column- and row-wise styles, for both recipes.

What else to know. Float8 keeps 2-3 significant bits: on a small GPT a gradient is within about
15 % of fp32's (relative norm; cosine above 0.98), the loss within 1e-3 (tests/parallel/
test_float8.py measures it). A zero-bubble schedule's split backward runs a float8 layer's whole
backward in both of its halves (torchao makes both gradients in one autograd function): equal
gradients, two float8 matmuls more per layer and micro-batch. On a GPU the weight gradient's
matmul also needs the tokens of a micro-batch to be a multiple of 16 (`check_tokens`).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections import Counter
from dataclasses import dataclass

from torch import nn

from brigade.config.precision import FLOAT8_RECIPES, check_float8
from brigade.errors import BrigadeError

MULTIPLE = 16  # torch._scaled_mm on a GPU: a matmul's inner and output-column sizes (features, tokens)
NEEDS = "0.18"  # the oldest torchao this module was written against (pyproject's float8 extra)
FIX = "pip install 'brigade[float8]'"


class Recipe(enum.Enum):
    """How float8 scales its tensors (torchao's recipe names)."""

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"


RECIPES = FLOAT8_RECIPES  # what --float8 accepts: the configuration's names, which Recipe's values are


def recipe_of(name: str | Recipe) -> Recipe:
    """The recipe called `name`.

    Raises:
        BrigadeError: a name that is not one, in one line.
    """
    if isinstance(name, Recipe):
        return name
    check_float8(name)
    return Recipe(name)


def torchao_float8():
    """`torchao.float8`, imported quietly: torchao's import logs a warning for each CUDA extension
    it cannot load (mxfp8, CUTLASS), which brigade's float8 training never calls.

    Raises:
        BrigadeError: torchao missing or older than `NEEDS`, with the command that installs it.
    """
    noisy = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in noisy]
    try:
        for lg in noisy:
            lg.setLevel(logging.ERROR)
        import torchao
        import torchao.float8 as ao
    except ImportError:
        raise BrigadeError(f"--float8 needs torchao (>= {NEEDS}), which is not installed: {FIX}") from None
    finally:
        for lg, level in zip(noisy, levels):
            lg.setLevel(level)
    if _version(torchao.__version__) < _version(NEEDS):
        raise BrigadeError(f"--float8 needs torchao >= {NEEDS}, found {torchao.__version__}: {FIX}")
    return ao


def _version(text: str) -> tuple[int, ...]:
    """(major, minor) of a version string: "0.18.0+cu126" -> (0, 18); unreadable -> (0, 0)."""
    parts = text.split("+")[0].split(".")[:2]
    return tuple(int(p) if p.isdigit() else 0 for p in parts)


@dataclass(frozen=True)
class Conversion:
    """What `convert` did (or, for blocks another process holds, will do) to the whole model.

    converted: the float8 layers' names, "block.name" ("1.attn.qkv"); kept: (name, why) of every
    nn.Linear left in full precision; float8_all_gather: FSDP gathers the float8 weights in
    float8 (the stages are sharded and the recipe is tensorwise): `refresh_scales` applies.
    """

    recipe: Recipe
    converted: tuple[str, ...]
    kept: tuple[tuple[str, str], ...]
    float8_all_gather: bool

    def line(self) -> str:
        """One line for the run's first lines: what was converted, what was kept and why."""
        done = [_split(name) + ("",) for name in self.converted]
        text = f"float8 {self.recipe.value}: converted {len(done)} linear layers ({_summary(done)})"
        if self.float8_all_gather:
            text += ", all-gathered in float8 under FSDP"
        if self.kept:
            kept = _summary([_split(n) + (why,) for n, why in self.kept])
            text += f"; kept {len(self.kept)} in full precision: {kept}"
        return text


def _split(name: str) -> tuple[int, str]:
    block, _, inner = name.partition(".")
    return int(block), inner


def _summary(items: list[tuple[int, str, str]]) -> str:
    """(block, name, note) triples as "q, k in blocks 1-4 (note); out in block 5"."""
    blocks: dict[tuple[str, str], list[int]] = {}
    for b, name, note in items:
        blocks.setdefault((name, note), []).append(b)
    groups: dict[tuple[str, str], list[str]] = {}
    for (name, note), bs in blocks.items():
        groups.setdefault((_span(bs), note), []).append(name)
    return "; ".join(f"{', '.join(names)} in {span}" + (f" ({note})" if note else "")
                     for (span, note), names in groups.items())


def _span(indices: list[int]) -> str:
    """[1, 2, 3, 5] -> "blocks 1-3, 5"; [2] -> "block 2"."""
    runs: list[list[int]] = []
    for i in sorted(set(indices)):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    text = ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
    return f"block {text}" if len(indices) == 1 else f"blocks {text}"


def eligible(blocks: list[nn.Module]) -> tuple[list[tuple[int, str]], list[tuple[int, str, str]]]:
    """([(block, name)] to convert, [(block, name, why)] to keep) over every nn.Linear of the whole
    model's `blocks` (the module docstring's rules); pure: no torchao, nothing changed, so it
    reads blocks on the meta device and blocks other processes hold alike."""
    shared = _shared(blocks)
    take, keep = [], []
    for i, block in enumerate(blocks):
        for name, m in block.named_modules():
            if isinstance(m, nn.Linear):
                why = _refusal(i, len(blocks), name, m, id(m) in shared)
                (keep.append((i, name or "(the block)", why)) if why else take.append((i, name)))
    return take, keep


def _shared(blocks: list[nn.Module]) -> set[int]:
    """ids of the nn.Linear modules a swap cannot replace alone: one that two places hold, or one
    whose weight another module holds too (a head tied to the embedding)."""
    places: Counter[int] = Counter()
    holders: Counter[int] = Counter()
    linears = []
    for block in blocks:
        for _, m in block.named_modules(remove_duplicate=False):
            places[id(m)] += 1
            if places[id(m)] == 1:
                holders.update(id(p) for p in m.parameters(recurse=False))
                if isinstance(m, nn.Linear):
                    linears.append(m)
    return {id(m) for m in linears if places[id(m)] > 1 or holders[id(m.weight)] > 1}


def _refusal(index: int, n_blocks: int, name: str, m: nn.Linear, shared: bool) -> str:
    """Why block `index`'s Linear `m` (`name` in it) stays in full precision ("" when it converts)."""
    if index == n_blocks - 1:
        return "the output head"
    if index == 0:
        return "the input block"
    if not name:  # the swap would hand back a new block, and the stages hold the old one
        return "a block that is one nn.Linear: put it in a module to convert it"
    if m.in_features % MULTIPLE or m.out_features % MULTIPLE:
        return f"{m.in_features} in, {m.out_features} out: float8 kernels need multiples of {MULTIPLE}"
    if shared:
        return "its weight is shared with another layer"
    return ""


def convert(blocks: list[nn.Module], recipe: str | Recipe, sharded: bool = False,
            held: list[int] | None = None) -> Conversion:
    """Swap the eligible nn.Linear layers of the held blocks for float8 ones, in place.

    Call it once, on the plain blocks, before any other wrapper (the module docstring's order).

    Args:
        blocks: the whole model's blocks ([first, body..., last]): which layers convert is decided
            over all of them, so every process reports the same line.
        recipe: "tensorwise" or "rowwise".
        sharded: FSDP2 will shard these blocks: with tensorwise, their weights are then wrapped to
            be all-gathered in float8 (`refresh_scales` applies).
        held: the indices of the blocks this process holds, the only ones changed (default: all).

    Returns:
        the `Conversion` of the whole model (its `line()` for the run's first lines).

    Raises:
        BrigadeError: an unknown recipe; torchao missing or too old; a model in which nothing
            converts; a layer already converted, or whose weight is already a DTensor (tensor
            parallel or sharding applied before float8).
    """
    recipe = recipe_of(recipe)
    ao = torchao_float8()
    take, keep = eligible(blocks)
    if not take:
        body = f"blocks 1 to {len(blocks) - 2}" if len(blocks) > 2 else "none: only a first and a last block"
        raise BrigadeError(f"--float8 {recipe.value} converts nothing in this model: no nn.Linear in its "
                           f"body ({body}) has in and out features that are multiples of {MULTIPLE} and a "
                           "weight of its own; run without --float8")
    gather = sharded and recipe is Recipe.TENSORWISE
    config = dataclasses.replace(ao.Float8LinearConfig.from_recipe_name(recipe.value),
                                 enable_fsdp_float8_all_gather=gather)
    mine = set(range(len(blocks)) if held is None else held)
    here = [(i, name) for i, name in take if i in mine]  # in model order
    for i, name in here:
        _check_plain(i, name, blocks[i].get_submodule(name))
    names = set(here)
    for i in sorted({i for i, _ in here}):
        ao.convert_to_float8_training(blocks[i], config=config,
                                      module_filter_fn=lambda m, fqn, i=i: (i, fqn) in names)
    if gather:  # snapshots keep the fp32 weight, not the wrapper that gathers it in float8
        for i, name in here:
            blocks[i].get_submodule(name).register_state_dict_post_hook(_master_weight)
    return Conversion(recipe, tuple(f"{i}.{n}" for i, n in take), tuple((f"{i}.{n}", w) for i, n, w in keep),
                      gather)


def _check_plain(index: int, name: str, m: nn.Linear) -> None:
    """A layer float8 may swap: not converted yet, its weight not yet split or sharded."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_linear import Float8Linear

    where = f"block {index}'s {name}"
    if isinstance(m, Float8Linear):
        raise BrigadeError(f"{where} is already a float8 layer: convert the blocks once")
    if isinstance(m.weight, DTensor):
        raise BrigadeError(f"{where} has a DTensor weight (tensor parallel or sharding came first): "
                           "convert to float8 before every other wrapper")


def _master_weight(module: nn.Module, state_dict: dict, prefix: str, _metadata) -> None:
    """State-dict hook of a layer whose weight FSDP gathers in float8: the weight stored as the fp32
    tensor torchao's wrapper holds, not as the wrapper. A snapshot then holds plain tensors under
    the unconverted model's names, which any layout reads without torchao; and since the plain
    tensor shares the parameter's memory, a snapshot loaded through this state dict lands in it."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Wrapped

    key = prefix + "weight"
    t = state_dict.get(key)
    if isinstance(t, DTensor) and isinstance(t._local_tensor, Wrapped):
        state_dict[key] = DTensor.from_local(t._local_tensor._tensor.detach(), t.device_mesh, t.placements,
                                             run_check=False, shape=t.shape, stride=t.stride())
    elif isinstance(t, Wrapped):
        state_dict[key] = t._tensor.detach()


def refresh_scales(module: nn.Module) -> None:
    """Compute the float8 scale of every weight in `module` that FSDP gathers in float8, for the
    all-gathers of the next step: one all-reduce for all of them (per mesh) where each all-gather
    would otherwise reduce its own weight's largest value first.

    When: after every optimizer step, once the weights have changed and before the next forward,
    on every process of the shard group with the same blocks (the trainer's owned blocks, every
    stage of this process at once); or never. A scale, once set, stays until the next call
    replaces it: skipping the call after a later step would cast the new weights with the old
    scale, clipping any that grew. Does nothing where no weight is gathered in float8 (rowwise,
    or stages not sharded): `Conversion.float8_all_gather` says whether to call it at all.
    """
    from torch.distributed.tensor import DTensor

    ao = torchao_float8()
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Wrapped

    by_mesh: dict = {}
    for m in module.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, Float8Linear) and isinstance(w, DTensor) and isinstance(w._local_tensor, Wrapped):
            by_mesh.setdefault(w.device_mesh, []).append(m)
    for layers in by_mesh.values():  # in module order: the same on every process of a mesh
        ao.precompute_float8_dynamic_scale_for_fsdp(nn.ModuleList(layers))


def check_tokens(tokens: int) -> None:
    """A micro-batch of `tokens` tokens (rows of each linear layer's input) suits float8 on a GPU:
    the weight gradient multiplies over them, and torch._scaled_mm there needs that inner
    dimension a multiple of 16 (a CPU takes any, but a run checked here should run there).

    Raises:
        BrigadeError: `tokens` not a multiple of 16, in one line.
    """
    if tokens % MULTIPLE:
        raise BrigadeError(f"--float8: a micro-batch holds {tokens} tokens (batch / micro-batches x sequence "
                           f"length), which float8's weight-gradient matmul needs to be a multiple of "
                           f"{MULTIPLE} on a GPU: choose a batch size, micro-batch count and sequence length "
                           f"that make it one")
