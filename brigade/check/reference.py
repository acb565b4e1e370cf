"""`brigade check`'s one-device reference: what every pipeline is compared with.

The reference runs the same blocks (a deep copy that keeps ties) on one device, on the whole
batch, or micro-batch after micro-batch where micro-batching changes the result: BatchNorm's
statistics, and float8's scales (--float8: the reference's copy is converted too, and each
matmul's scale comes from the largest value of its micro-batch); it is compared under exact
arithmetic (`exact_matmuls`): no TF32, deterministic cuDNN.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from brigade.models import ModelSpec, documents, moe
from brigade.pipeline.batches import feed, microbatch
from brigade.pipeline.stages.side_inputs import whole


def has_batchnorm(blocks: list[nn.Module]) -> bool:
    """Whether any block holds a BatchNorm (micro-batching then changes what it computes)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for b in blocks for m in b.modules())


def reference(spec: ModelSpec, x, y, m: int, lr: float, device: torch.device, float8: str = "",
              replicas: int = 1, adapters=None):
    """Single device: loss, and per block its gradients and post-SGD state, of a deep copy that
    keeps ties (one device sums their uses: the gradient every stage's copy must hold). Where it
    runs micro-batch by micro-batch, the batch is cut as the pipeline's `replicas` cut it: into
    their slices, each into `m` micro-batches.

    A Hugging Face directory's model (`spec.hf`) is compared with the unmodified transformers
    model instead, its tensors matched to the blocks' by their directory names; under `float8`
    with its own blocks converted (transformers' model has no float8 to compare with), or with
    --lora's `adapters` on them (`parallel.lora`): gradients are then the adapters' alone."""
    if spec.hf is not None and not float8 and adapters is None:
        return _transformers_reference(spec, x, y, lr, device)
    blocks = copy.deepcopy(spec.blocks)  # one deepcopy of the list keeps ties between blocks
    moe.per_step(blocks, microbatch.batch_size_of(x))  # the whole batch: its balancing loss's share
    if float8:
        from brigade.parallel.float8 import convert

        convert(blocks, float8)
    if adapters is not None:
        from brigade.parallel import lora

        lora.apply(blocks, list(range(len(blocks))), adapters)
    model = whole(blocks).to(device)  # side inputs, where blocks declare them, taken out of the batch
    x, y = feed.to(x, device), feed.to(y, device)
    per_mb = m > 1 and (has_batchnorm(spec.blocks) or bool(float8))
    if per_mb:
        total = 0.0
        for xs, ys, w in _pieces(x, y, m, replicas):
            loss = spec.loss_fn(model(xs), ys) * w
            loss.backward()
            total += loss.detach()
        loss = total
    else:
        loss = spec.loss_fn(model(x), y)
        loss.backward()
    grads = [[p.grad.clone() for p in b.parameters() if p.requires_grad] for b in blocks]
    torch.optim.SGD(model.parameters(), lr=lr).step()
    state = [[t.detach().clone() for t in b.state_dict().values()] for b in blocks]
    why = "float8" if float8 else "BatchNorm"
    return float(loss.detach()), grads, state, (f"micro-batched ({why})" if per_mb else "full batch")


def _pieces(x, y, m: int, replicas: int):
    """(inputs, targets, share of the batch's loss) of each micro-batch of each replica's slice."""
    out = []
    for xr, yr in zip(microbatch.split_structure(x, replicas), microbatch.split_structure(y, replicas)):
        shares = microbatch.weights(microbatch.batch_size_of(xr), m)
        out += [(xs, ys, w / replicas) for xs, ys, w in zip(microbatch.split_structure(xr, m),
                                                            microbatch.split_structure(yr, m), shares)]
    return out


def _transformers_reference(spec: ModelSpec, x, y, lr: float, device: torch.device):
    """`reference` for `hf:DIR`: transformers' own model on the batch's token ids (and, where the
    rows pack documents, their positions and block-causal mask, which transformers takes as a
    custom 4-D mask: `models.documents`)."""
    model = spec.hf.original().to(device)
    packing = {}
    if x.get("documents") is not None:
        d = x["documents"].to(device)
        packing = {"attention_mask": documents.block_causal(d), "position_ids": documents.positions(d)}
    loss = spec.loss_fn(model(input_ids=x["input_ids"].to(device), **packing).logits, y.to(device))
    loss.backward()
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied head's name too
    names = [b.memory_names() for b in spec.blocks]  # transformers' own (a mixture's experts stacked)
    grads = [[params[names[i][n]].grad.clone() for n, _ in b.named_parameters()]
             for i, b in enumerate(spec.blocks)]
    torch.optim.SGD(model.parameters(), lr=lr).step()
    state = model.state_dict()
    after = [[state[names[i][n]].detach().clone() for n in b.state_dict()] for i, b in enumerate(spec.blocks)]
    return float(loss.detach()), grads, after, "transformers"


@contextlib.contextmanager
def exact_matmuls():
    """fp32 matmuls and convolutions in full precision while comparing.

    cuBLAS and cuDNN may use TF32 for fp32 work (10-bit mantissas); against the fp32
    reference that is a mismatch of about 1e-3, not a pipeline bug. cuDNN also keeps to
    deterministic algorithms, chosen the same way for the reference and the stages.
    """
    flags = torch.backends.cuda.matmul, torch.backends.cudnn
    names = [(flags[0], "allow_tf32"), (flags[1], "allow_tf32"), (flags[1], "deterministic"),
             (flags[1], "benchmark")]
    saved = [getattr(obj, name) for obj, name in names]
    for (obj, name), value in zip(names, (False, False, True, False)):
        setattr(obj, name, value)
    try:
        yield
    finally:
        for (obj, name), value in zip(names, saved):
            setattr(obj, name, value)
