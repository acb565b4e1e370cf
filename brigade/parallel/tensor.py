"""Tensor parallel: each block's matmuls split over the `tp` processes of a DeviceMesh (DTensor).

A block says how it splits with a plan, a dict from its submodules' names to a style:

    "colwise"            nn.Linear: each process holds a slice of the output features (weight
                         rows); nn.Embedding: a slice of the embedding dimension
    "rowwise"            nn.Linear: a slice of the input features (weight columns), the partial
                         outputs summed; nn.Embedding: a slice of the vocabulary
    (style, units)       the same, where the split dimension is `units` equal groups that must
                         stay whole (attention heads): tp has to divide `units`
    "vocab"              an output head's nn.Linear: each process holds a slice of the vocabulary
                         (weight rows), and its logits stay split along their last dimension, a
                         DTensor the loss reads in parallel (`parallel.vocab`): no process ever
                         holds the whole (B, T, V) logits or their gradient

torch's `ColwiseParallel` / `RowwiseParallel` do the work (`parallelize_module`): their
parameters become DTensors sharded over the tp mesh, every block's input and output stays a
plain tensor, whole on every tp process. So nothing between blocks changes: the pipeline sends
what it sent, a shared parameter outside the plan (a tied embedding and head) is an ordinary
tensor equal on every tp process. The one exception is the last block's output under a "vocab"
entry: the loss takes it split. A colwise layer followed by a rowwise
one (attention's q/k/v then output, an MLP's up then down) needs one all-reduce in the forward
and one in the backward, the Megatron-LM pattern.

    block input (whole) ─► colwise: local heads / hidden slice ─► rowwise ─► all-reduce ─► whole

Under sequence parallel (on by default, `parallel.sequence`) two more styles say where a block's
positions may be split instead of kept whole:

    "sequence"           a norm: it runs on this process's part of the sequence, its weight
                         replicated; the block then takes and gives parts, (B, T/tp, C), its
                         rowwise outputs are reduce-scattered into parts and its colwise inputs
                         gathered (with sequence parallel off, both entries are left out)
    "gather"             a module whose colwise layers share one input (an attention, an MLP):
                         its input is gathered once, for all of them, as a replicated DTensor

A mixture of experts (`models.moe.MoE`) is not split by tensor parallel: it runs whole on every
tp process, on the whole sequence (its experts are split by expert parallel instead,
`parallel.experts`). Its entry says so:

    "whole"              a module whose weights stay whole on every tp process, each of which
                         computes it on every position: under sequence parallel its input is
                         gathered from parts into the whole sequence (a plain tensor) and its
                         output cut back to this process's part (`sequence.to_whole`, `to_part`),
                         so its gradients are complete and the same on every tp process

One more style is for a module that runs on the heads a process holds but whose weight all heads
share (Qwen3's norms of q and k, applied per head):

    "per-head"           its weight stays whole on every tp process, and its gradient, which
                         sees only this process's heads, is summed over tp after the step's
                         last backward (`sum_per_head_grads`)

An empty plan `{}` keeps a block whole on every tp process (the replicated path: an embedding, and
a head tied to it, which shares the embedding's whole weight). An untied head splits its
vocabulary ("vocab"): at a 128K vocabulary and sequence 8192 its fp32 logits are 4 GiB a sample,
the largest tensor a Llama step makes, and split they are 1/tp of it. A
block without a plan is refused under tp > 1, rather than silently computed tp times over.
Plans come from the block (`block.tp_plan`) or from a model file's `tp_plan = {index: plan}`
(`brigade.models`). Models know nothing else of it: a block whose attention splits its heads
reads the number it holds from the tensor's shape, not from its configuration.

Order: tensor parallel before FSDP2 (as torchtitan composes them), which shards over the
data-parallel dimensions of the same DeviceMesh and so makes each split parameter a 2-D DTensor.
Recompute wraps a block's forward and runs its split submodules again, collectives included:
the order of the two does not matter.
"""

from __future__ import annotations

from torch import nn

from brigade.errors import BrigadeError
from brigade.models.moe import MoE

STYLES = ("colwise", "rowwise", "vocab")  # split a module's weights
SEQUENCE_STYLES = ("sequence", "gather", "whole")  # place a module in a sequence-parallel block
WHOLE_STYLES = ("per-head",)  # keep a module whole, its gradient summed over tp


def plan_of(block: nn.Module) -> dict | None:
    """The block's tensor-parallel plan (`tp_plan`), or None when it has none."""
    plan = getattr(block, "tp_plan", None)
    return None if plan is None else dict(plan)


def style_of(entry) -> tuple[str, int | None]:
    """(style, units) of one plan entry: "colwise" or ("colwise", 4)."""
    if isinstance(entry, str):
        return entry, None
    if isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[1], int):
        return entry[0], entry[1]
    return repr(entry), None


def _split_size(module: nn.Module, style: str) -> int | None:
    """The size of the dimension `style` splits in `module` (None: a kind it cannot split)."""
    if isinstance(module, nn.Linear):
        return module.in_features if style == "rowwise" else module.out_features
    if style == "vocab":
        return None
    if isinstance(module, nn.Embedding):
        return module.embedding_dim if style == "colwise" else module.num_embeddings
    return None


def _check_entry(where: str, block: nn.Module, name: str, entry, tp: int) -> None:
    style, units = style_of(entry)
    if style not in STYLES + SEQUENCE_STYLES + WHOLE_STYLES or (units is not None and style not in STYLES):
        raise BrigadeError(f"{where}'s tp_plan gives {name} the style {style}: expected 'colwise', "
                           "'rowwise', (style, units) like ('colwise', 4), 'vocab', 'sequence', "
                           "'gather', 'whole' or 'per-head'")
    module = dict(block.named_modules()).get(name)
    if module is None:
        raise BrigadeError(f"{where}'s tp_plan names {name!r}, which the block does not have: name "
                           "its submodules as named_modules() does, like 'attn.qkv'")
    if style in SEQUENCE_STYLES + WHOLE_STYLES:
        return
    size = _split_size(module, style)
    if size is None:
        if style == "vocab":
            raise BrigadeError(f"{where}'s tp_plan splits {name}, a {type(module).__name__}, as vocab: "
                               "that style splits an output head's nn.Linear only; leave it out of the plan")
        raise BrigadeError(f"{where}'s tp_plan splits {name}, a {type(module).__name__}: tensor "
                           "parallel splits nn.Linear and nn.Embedding only; leave it out of the plan")
    if units is not None and units % tp:
        raise BrigadeError(f"{where}: {name} splits into {units} heads (or groups), which --tp {tp} "
                           f"does not divide: use a --tp that divides {units}")
    if style == "vocab" and name != last_linear(block):
        raise BrigadeError(f"{where}'s tp_plan splits {name} as 'vocab', but the loss reads the block's "
                           f"last layer ({last_linear(block)}): give 'vocab' to the output head only")
    if size % tp and style != "vocab":  # a vocabulary tp does not divide stays whole (`plan_at`)
        raise BrigadeError(f"{where}: {name}'s {size} {'input' if style == 'rowwise' else 'output'} "
                           f"features do not split evenly over --tp {tp}: use a --tp that divides {size}")


def last_linear(block: nn.Module) -> str | None:
    """The name of the last nn.Linear a block registers (its output head's, for a head)."""
    names = [n for n, m in block.named_modules() if isinstance(m, nn.Linear)]
    return names[-1] if names else None


def plan_at(block: nn.Module, tp: int) -> dict | None:
    """The block's plan as `tp` processes apply it: its own, but {} for a head whose "vocab" entry
    `tp` does not divide (GPT-2's 50257 at tp 2): such a head stays whole on every tp process,
    norm included, as a tied head does, rather than refuse the degree. (Split along the sequence
    but whole in its vocabulary, its weight would see only this process's positions.)"""
    plan = plan_of(block)
    modules = dict(block.named_modules())
    if plan and any(style_of(e)[0] == "vocab" and modules[n].out_features % tp for n, e in plan.items()):
        return {}
    return plan


def _experts_whole(where: str, block: nn.Module, plan: dict) -> None:
    """Refuse a block whose mixture of experts its plan does not name "whole" (nor a module
    around it): tensor parallel would leave it to run on a part of the sequence, or split what
    it must not."""
    whole = [n for n, e in plan.items() if style_of(e)[0] == "whole"]
    for name, m in block.named_modules():
        if isinstance(m, MoE) and not any(name == w or name.startswith(w + ".") for w in whole):
            raise BrigadeError(f"{where} has a mixture of experts ({name}) its tp_plan does not name: give "
                               f"it {{'{name}': 'whole'}} (it runs whole on every tp process), or use --tp 1")


def splits_vocab(block: nn.Module, tp: int) -> bool:
    """Whether the block splits its output along the vocabulary over `tp` processes (`plan_at`)."""
    return tp > 1 and any(style_of(e)[0] == "vocab" for e in (plan_at(block, tp) or {}).values())


def check_plans(blocks: list[nn.Module], tp: int, model: str = "the model") -> None:
    """Every block has a plan, and every plan splits evenly over `tp` (nothing to check at tp 1).

    Raises:
        BrigadeError: a block without a plan, an unknown style or submodule, a module kind that
            cannot be split, or heads / features that `tp` does not divide.
    """
    if tp == 1:
        return
    for i, block in enumerate(blocks):
        where = f"block {i} ({type(block).__name__}) of {model}"
        plan = plan_of(block)
        if plan is None:
            raise BrigadeError(f"{where} has no tensor-parallel plan, so --tp {tp} cannot split it: give "
                               "the block a tp_plan ({submodule: 'colwise' | 'rowwise'}; {} keeps it "
                               "whole on every tp process), or the model file tp_plan = {index: plan}, "
                               "or use --tp 1")
        _experts_whole(where, block, plan)
        for name, entry in plan.items():
            _check_entry(where, block, name, entry, tp)
        if any(style_of(e)[0] == "vocab" for e in plan.values()) and i != len(blocks) - 1:
            raise BrigadeError(f"{where} splits its output as 'vocab', but only the last block's output "
                               "goes to the loss: give 'vocab' to the head's linear layer only")


def parallelize(blocks: list[nn.Module], mesh, sequence: bool = True) -> None:
    """Split each block's planned submodules over the 1-D tp `mesh`, in place (see the module
    docstring); blocks with an empty plan stay as they are. `sequence`: the blocks whose plan
    names a "sequence" entry take part in sequence parallelism (`parallel.sequence`); the
    assembler puts the boundaries between them and whole blocks. Call `check_plans` first."""
    from torch.distributed.tensor.parallel import parallelize_module

    from brigade.parallel import sequence as sp

    for block in blocks:
        plan = plan_at(block, mesh.size()) or {}
        parts = sequence and sp.takes_part(block, plan)
        styles = {name: _style(name, style_of(e)[0], plan, parts) for name, e in plan.items()}
        styles = {name: s for name, s in styles.items() if s is not None}
        if styles:
            parallelize_module(block, mesh, styles)
        for name, e in plan.items():
            if parts and style_of(e)[0] == "gather":
                block.get_submodule(name).register_forward_pre_hook(sp.gathering(mesh), with_kwargs=True)
            if parts and style_of(e)[0] == "whole":
                sp.whole_sequence(block.get_submodule(name), mesh)
        if parts:
            sp.own_masks(block, mesh)


def _style(name: str, style: str, plan: dict, parts: bool):
    """torch's ParallelStyle for one entry of a block's plan; None for an entry that is not one
    (a "gather", which is a hook; a sequence entry without sequence parallel)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if style == "vocab":  # its input gathered from parts (or whole), its logits left split
        return ColwiseParallel(input_layouts=Shard(1) if parts else Replicate(), output_layouts=Shard(-1),
                               use_local_output=False)
    if style == "sequence":
        return SequenceParallel(use_local_output=True) if parts else None
    if style in ("gather", "per-head", "whole"):
        return None
    if style == "rowwise":
        return RowwiseParallel(output_layouts=Shard(1)) if parts else RowwiseParallel()
    gathered = any(name.startswith(g + ".") for g, e in plan.items() if style_of(e)[0] == "gather")
    return ColwiseParallel(input_layouts=Shard(1)) if parts and not gathered else ColwiseParallel()


def sum_per_head_grads(blocks, group) -> None:
    """Every "per-head" module's gradients (each saw only this process's heads) := their sum over
    the tp processes of `group`, so the weight stays the same on each."""
    import torch.distributed as dist

    from brigade.dtensors import local

    for block in blocks:
        for name, entry in (plan_of(block) or {}).items():
            if style_of(entry)[0] == "per-head":
                for p in block.get_submodule(name).parameters():
                    if p.grad is not None:
                        dist.all_reduce(local(p.grad), group=group)


def is_tp_sharded(t) -> bool:
    """Whether `t` (a parameter or gradient) is split over a mesh dimension named "tp": its
    squared norm is then a sum over the tp processes, not the same on each."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor):
        return False
    names = t.device_mesh.mesh_dim_names or ()
    return "tp" in names and not isinstance(t.placements[names.index("tp")], Replicate)
