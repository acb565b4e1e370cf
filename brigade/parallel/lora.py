"""LoRA: low-rank adapters on a model's linear layers, the rest of the model frozen.

A targeted `nn.Linear` of weight W (out, in) keeps W and gains two small parameters,

    lora_a  (r, in)    drawn like an nn.Linear's weight (Kaiming uniform), from the run's seed
    lora_b  (out, r)   zeros: the adapted model starts as the base model, exactly

and computes  y = x Wᵀ + b + (α / r) · (dropout(x) A ᵀ) Bᵀ. Only the adapters train: every other
parameter of the held blocks is frozen (`requires_grad` off), so the optimizer holds state for
the adapters alone, and DDP, FSDP2's reduce-scatter and the pipeline's gradient reductions
carry only their gradients (each skips a parameter that needs none).

Applied from outside, as the parallel wrappers are (`parallel.assemble`), after tensor and
context parallel: the adapter is a forward hook on the linear layer, put before the hooks tensor
parallel registered (`prepend`), so it sees what the layer's own forward sees. Under tensor
parallel that is a DTensor, and the adapters are DTensors placed to match the layer's split:

    colwise  W Shard(0):  A replicated, B Shard(0)     x (whole) → A → B → this slice of out
    rowwise  W Shard(1):  A Shard(1),   B replicated   x (slice) → A → partial → B → partial,
                                                       summed with the layer's own partial output
    whole    W whole:     both whole

A weight's module name keeps its name (`attn.qkv.weight`), so a Hugging Face directory's weights,
a tensor-parallel plan and an export read the base model as they do without LoRA; the adapters
are `attn.qkv.lora_a` and `attn.qkv.lora_b`. A snapshot of a LoRA run holds the adapters and
their optimizer state only (`snapshot.collective`): the base comes back from where the run took
it (the seed, or the hf:DIR directory).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from brigade.errors import BrigadeError
from brigade.models.hf.blocks import ADDED

# The attention and MLP projections, by the last parts of their names: the built-in GPT's and
# the Hugging Face families' (Llama, Qwen, Mistral: q/k/v/o_proj, gate/up/down_proj).
DEFAULT_TARGETS = ("attn.qkv", "attn.proj", "mlp.0", "mlp.2", "q_proj", "k_proj", "v_proj", "o_proj",
                   "gate_proj", "up_proj", "down_proj")
ADAPTERS = ADDED  # the names of the two parameters an adapted layer gains


@dataclass(frozen=True)
class LoraSpec:
    """A run's LoRA: rank r, alpha (the update is scaled by alpha / r), dropout on the adapter's
    input, the target names (empty: `DEFAULT_TARGETS`), and the seed A is drawn from."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ()
    seed: int = 0
    draw_b: bool = False  # B drawn like A rather than zero: `brigade check`, to compare its gradients

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def spec_of(model_cfg, seed: int) -> LoraSpec | None:
    """The LoRA of a `ModelConfig` (`--lora`, `--lora-alpha`, `--lora-dropout`, `--lora-targets`),
    None where --lora is 0.

    Raises:
        BrigadeError: a negative rank, a dropout outside [0, 1), alpha ≤ 0.
    """
    rank = model_cfg.lora
    if rank < 0:
        raise BrigadeError(f"--lora {rank}: the adapters' rank must be ≥ 1 (8 or 16 are usual); "
                           "0 trains every weight, without LoRA")
    if rank == 0:
        return None
    if not 0 <= model_cfg.lora_dropout < 1:
        raise BrigadeError(f"--lora-dropout {model_cfg.lora_dropout}: must be at least 0 and below 1")
    if model_cfg.lora_alpha <= 0:
        raise BrigadeError(f"--lora-alpha {model_cfg.lora_alpha}: must be above 0 (the update is "
                           "scaled by alpha / rank; 16 or 2 × the rank are usual)")
    names = tuple(n.strip() for n in model_cfg.lora_targets.split(",") if n.strip())
    return LoraSpec(rank, model_cfg.lora_alpha, model_cfg.lora_dropout, names, seed)


def check_with(float8: str) -> None:
    """Refuse what LoRA does not compose with: --float8 (its linear layers are torchao's).

    Raises:
        BrigadeError: one line.
    """
    if float8:
        raise BrigadeError(f"--lora with --float8 {float8}: the adapters are not converted to float8; "
                           "drop one of them")


def from_config(config: dict) -> LoraSpec | None:
    """The LoRA of a run, from its manifest's `config` (None: none, or a run from before --lora)."""
    from brigade.config import ModelConfig

    fields = {k: v for k, v in config.get("model", {}).items() if k.startswith("lora")}
    return spec_of(ModelConfig(**fields), config.get("train", {}).get("seed", 0))


def _linears(block: nn.Module) -> list[str]:
    return [name for name, m in block.named_modules() if isinstance(m, nn.Linear) and name]


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def targets(blocks: list[nn.Module], spec: LoraSpec) -> dict[int, list[str]]:
    """{block index: names of its linear layers LoRA adapts}, over the whole model (every process
    finds the same). A name is targeted when it is, or ends with, one of the spec's targets.

    Raises:
        BrigadeError: a target given that names no linear layer; defaults that name none.
    """
    found = {i: [n for n in _linears(b) if any(_matches(n, t) for t in spec.targets or DEFAULT_TARGETS)]
             for i, b in enumerate(blocks)}
    have = sorted({n for b in blocks for n in _linears(b)})
    shown = ", ".join(have[:12]) + (", …" if len(have) > 12 else "") or "none"
    for t in spec.targets:
        if not any(_matches(n, t) for b in blocks for n in _linears(b)):
            raise BrigadeError(f"--lora-targets {','.join(spec.targets)}: {t!r} names no linear layer of "
                               f"the model's blocks; they have: {shown}")
    if not any(found.values()):
        raise BrigadeError(f"--lora: none of the model's linear layers is an attention or MLP projection "
                           f"it knows by name; name them with --lora-targets (they have: {shown})")
    return {i: names for i, names in found.items() if names}


def apply(blocks: list[nn.Module], held: list[int], spec: LoraSpec, float8: str = "") -> int:
    """Adapters on the targeted linear layers of the held blocks `held`, every other parameter
    of theirs frozen, in place. Returns the count of adapter parameters (elements) held here.

    Called after tensor and context parallel and before sharding; the adapters' values do not
    depend on the layout (each A is drawn whole from the seed and its name, then split).

    Raises:
        BrigadeError: as `targets`; with --float8 (`check_with`)."""
    check_with(float8)
    chosen = targets(blocks, spec)
    count = 0
    for i in held:
        for p in blocks[i].parameters():
            p.requires_grad_(False)
        for name in chosen.get(i, []):
            count += _adapt(blocks[i].get_submodule(name), f"{i}.{name}", spec)
    return count


def _adapt(linear: nn.Linear, name: str, spec: LoraSpec) -> int:
    """Give `linear` its adapters and the hook that adds their output (module docstring)."""
    w = linear.weight
    g = torch.Generator().manual_seed(spec.seed * 1_000_003 + zlib.crc32(name.encode()))
    a = torch.empty(spec.rank, w.shape[1])
    bound = 1 / math.sqrt(w.shape[1])  # nn.Linear's init: kaiming_uniform(a=√5) is U(±1/√in)
    a.uniform_(-bound, bound, generator=g)
    b = torch.zeros(w.shape[0], spec.rank)
    if spec.draw_b:
        b.uniform_(-1 / math.sqrt(spec.rank), 1 / math.sqrt(spec.rank), generator=g)
    a, b = _placed(a, b, w)
    linear.register_parameter("lora_a", nn.Parameter(a))
    linear.register_parameter("lora_b", nn.Parameter(b))
    linear.lora_scale, linear.lora_dropout = spec.scale, spec.dropout
    linear.register_forward_hook(_add_adapter, prepend=True)
    return a.numel() + b.numel()


def _placed(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B on W's device and dtype; under tensor parallel, DTensors split to match W's
    split (the module docstring's table)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    a, b = a.to(w.device, w.dtype), b.to(w.device, w.dtype)
    if not isinstance(w, DTensor):
        return a, b
    (placement,) = w.placements
    if placement == Shard(0):
        pa, pb = Replicate(), Shard(0)
    elif placement == Shard(1):
        pa, pb = Shard(1), Replicate()
    else:
        pa = pb = Replicate()
    return distribute_tensor(a, w.device_mesh, [pa]), distribute_tensor(b, w.device_mesh, [pb])


def _add_adapter(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    x = F.dropout(args[0], module.lora_dropout, module.training) if module.lora_dropout else args[0]
    return output + F.linear(F.linear(x, module.lora_a), module.lora_b) * module.lora_scale


def is_adapter(name: str) -> bool:
    """Whether a parameter's name is an adapter's (`...attn.qkv.lora_a`)."""
    return name.rsplit(".", 1)[-1] in ADAPTERS


def merge(blocks: list[nn.Module]) -> None:
    """Fold every adapter into its layer's weight (W + α/r · B A), then remove it, in place: the
    plain model the adapters made, for an export. Single process, whole tensors."""
    for block in blocks:
        for m in block.modules():
            if isinstance(m, nn.Linear) and hasattr(m, "lora_a"):
                with torch.no_grad():
                    m.weight += (m.lora_b @ m.lora_a) * m.lora_scale
                del m.lora_a, m.lora_b
                for k, hook in list(m._forward_hooks.items()):
                    if hook is _add_adapter:
                        del m._forward_hooks[k]
