"""A mixture-of-experts feed-forward layer: a router picks k of E expert feed-forwards per token.

    x (…, C) ─► router: a score per expert (softmax or sigmoid of a linear layer)
             ─► top k per token (chosen on the scores, plus a balancing bias if one is kept),
                their weights the chosen scores, renormalised to sum to 1 where the family does
             ─► dispatch: each (token, choice) pair, sorted by expert ─► every expert's SwiGLU on
                its own rows, as one grouped matmul (`torch._grouped_mm`) or one matmul an expert
             ─► combine: each token the weighted sum of its k outputs  (+ a shared expert's)

Dropless: every token reaches every expert it chose (no capacity, nothing dropped), so an expert's
rows are however many chose it, and a run split any way computes what one device computes.

Dispatch and combine are the seam expert parallelism takes (`Dispatch`): here they sort and
unsort rows on this process; split over processes (`parallel.experts.AllToAll`) they become an
all-to-all that sends each row to the process holding its expert, and back. The experts' weights
are stacked in a module of their own (`GroupedExperts`, as transformers stacks them), so a process
holding some experts holds a slice of the first dimension, and sharding can wrap them alone.

Balance (two ways, as the families do):

    aux_coef    the load-balancing loss (Switch Transformer's, which Mixtral, Qwen-MoE and OLMoE
                use): E · Σ_e f_e · P_e, f_e the share of the choices that went to expert e and
                P_e its mean score; taken per sequence and averaged over the sequences (DeepSeek-
                V3's sequence-wise form), so a batch cut into micro-batches or replicas gives the
                same total as one device on the whole batch. It joins the training loss through
                the backward only (`_AddAux`): the layer's output is unchanged, and its input's
                gradient gains aux_coef × ∂aux/∂x, scaled by this forward's share of the step's
                sequences (`samples_per_step`)
    bias_rate   DeepSeek-V3's balancing without a loss: a bias per expert, added to the scores
                for choosing only (never to the weights), moved after each step by bias_rate
                towards the under-loaded experts (`update_bias`)

The layer keeps what the last forward saw (`load`: the choices per expert; `aux`: the balancing
loss; `entropy`: the router's mean entropy), and adds it to what the step so far saw (`seen`,
which `take_seen` hands over and clears: the run's metrics, `train.experts`): training forwards
only, and a forward that recompute runs again inside a backward is not counted twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    """The shape and rules of one MoE layer (module docstring)."""

    experts: int
    top_k: int
    hidden: int  # each expert's SwiGLU width
    scores: str = "softmax"
    renormalize: bool = True  # the k chosen weights rescaled to sum to 1
    shared_hidden: int = 0  # a shared expert's width (0: none)
    aux_coef: float = 0.0
    bias_rate: float = 0.0

    def check(self) -> None:
        """Raises ValueError on a top-k outside 1..experts or an unknown score function."""
        if self.experts < 1 or not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top-k {self.top_k} of {self.experts} experts: top-k must be from 1 to "
                             "the number of experts")
        if self.scores not in SCORES:
            raise ValueError(f"router scores {self.scores!r}: expected one of {', '.join(SCORES)}")


class Dispatch:
    """Rows to experts and back on this process (module docstring): the local case of the seam.
    `parallel.experts.AllToAll` is the other: the same two calls across the expert group."""

    def dispatch(self, rows: torch.Tensor, expert: torch.Tensor, experts: int):
        """(the rows this process's experts take, sorted by expert; how many each takes; what
        `combine` needs to bring their outputs back) of `rows`, row i chosen for `expert[i]`."""
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=experts)
        return rows[order], counts, order

    def combine(self, out: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """The expert outputs `out` back in the order of the rows dispatched."""
        return torch.empty_like(out).index_copy(0, order, out)


class MoE(nn.Module):
    """The layer (module docstring): (…, C) → (…, C)."""

    def __init__(self, width: int, cfg: MoEConfig):
        super().__init__()
        cfg.check()
        self.cfg = cfg
        self.gate = nn.Linear(width, cfg.experts, bias=False)  # the router (transformers' name)
        e = cfg.experts
        self.experts = GroupedExperts(e, width, cfg.hidden)
        self.shared = SwiGLU(width, cfg.shared_hidden) if cfg.shared_hidden else None
        self.register_buffer("bias", torch.zeros(e), persistent=cfg.bias_rate > 0)
        self.dispatcher = Dispatch()
        self.samples_per_step: float | None = None  # None: this forward's own sequences
        cpu = torch.device("cpu")  # figures, not weights: real even where the layer is built on meta
        self.load = torch.zeros(e, device=cpu)
        self.aux = torch.zeros((), device=cpu)
        self.entropy = torch.zeros((), device=cpu)
        self.seen = torch.zeros(e + 4, dtype=torch.float64, device=cpu)  # load, Σ aux·seqs, seqs,
        # Σ entropy·rows, rows

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores (N, E), weights (N, k), chosen experts (N, k)) of the rows `x` (N, C)."""
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.cfg.scores == "softmax" else logits.sigmoid()
        chosen = torch.topk(scores.detach() + self.bias, self.cfg.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.cfg.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return scores, weights, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        scores, weights, chosen = self.route(rows)
        k = self.cfg.top_k
        flat = chosen.reshape(-1)
        grouped, counts, order = self.dispatcher.dispatch(rows.repeat_interleave(k, 0), flat,
                                                          self.cfg.experts)
        out = self.dispatcher.combine(self.experts(grouped, counts), order)
        y = (out.view(-1, k, shape[-1]) * weights.unsqueeze(-1).to(out.dtype)).sum(1)
        if self.shared is not None:
            y = y + self.shared(rows)
        aux = self._aux(scores, chosen, shape) if self.cfg.aux_coef else None
        self._observe(scores, flat, aux, shape[0] if len(shape) > 2 else 1)
        if aux is not None and self.training and torch.is_grad_enabled():
            share = shape[0] / (self.samples_per_step or shape[0])
            y = _AddAux.apply(y, aux * (self.cfg.aux_coef * share))
        return y.view(shape)

    def _aux(self, scores: torch.Tensor, chosen: torch.Tensor, shape) -> torch.Tensor:
        """The sequence-wise load-balancing loss (module docstring): its mean over sequences."""
        e = self.cfg.experts
        seqs = shape[0] if len(shape) > 2 else 1
        p = scores.view(seqs, -1, e)  # (S, T, E)
        p = p / p.sum(-1, keepdim=True) if self.cfg.scores == "sigmoid" else p
        hits = F.one_hot(chosen.view(seqs, -1, self.cfg.top_k), e).sum(2).float()  # (S, T, E)
        f = hits.mean(1) / self.cfg.top_k  # each sequence's share of choices per expert
        return (e * (f * p.mean(1)).sum(-1)).mean()

    @torch.no_grad()
    def _observe(self, scores: torch.Tensor, flat: torch.Tensor, aux: torch.Tensor | None, seqs: int) -> None:
        """Keep what this forward saw (module docstring), detached, and add it to the step's."""
        self.load = torch.bincount(flat, minlength=self.cfg.experts).to(torch.float32)
        p = scores / scores.sum(-1, keepdim=True)
        self.entropy = -(p * p.clamp_min(1e-20).log()).sum(-1).mean()
        self.aux = aux.detach() if aux is not None else torch.zeros(())
        if not self.training or torch._C._current_graph_task_id() != -1:
            return  # an evaluation's forward, or recompute inside a backward (counted already)
        rows, dev = scores.shape[0], self.load.device  # (on the device: no wait for it here)
        counts = torch.tensor([seqs, rows], dtype=torch.float64, device=dev)
        aux, entropy = self.aux.double().to(dev) * seqs, self.entropy.double() * rows
        step = torch.stack([aux, counts[0], entropy, counts[1]])
        self.seen = self.seen.to(dev) + torch.cat([self.load.double(), step])

    def take_seen(self) -> torch.Tensor:
        """What the step's forwards saw since the last call (module docstring), and start again:
        (E + 4,) float64: the choices per expert, then Σ aux × sequences, sequences, Σ entropy ×
        tokens, tokens (sums, so that micro-batches and replicas add up)."""
        seen, self.seen = self.seen, torch.zeros_like(self.seen)
        return seen

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's step (module docstring): each expert's bias up by bias_rate when it took
        fewer than the mean of `load` (the step's choices per expert, summed over every process
        and micro-batch), down when more."""
        if self.cfg.bias_rate:
            self.bias += self.cfg.bias_rate * torch.sign(load.mean() - load)


def per_step(modules, samples: float) -> None:
    """Tell every MoE layer in `modules` how many sequences this process's step takes in all (its
    replica's batch, over every micro-batch and accumulated chunk): the share each forward's
    balancing loss carries (module docstring). Called by whoever splits the step's batch. Where
    the loss is scaled (fp16's loss scale, a chunk's 1/k), `samples` is divided by that scale, so
    the balancing loss's gradient is scaled with the loss's and unscaled with it: a float, and
    not rounded (at a loss scale of 65536 it is far below one)."""
    for module in modules:
        for m in module.modules():
            if isinstance(m, MoE):
                m.samples_per_step = samples


class GroupedExperts(nn.Module):
    """E SwiGLU feed-forwards, their weights stacked as transformers stacks them (its Qwen3-MoE,
    Mixtral and OLMoE experts): `gate_up_proj` (E, 2H, C), each expert's gate and up rows one
    above the other, and `down_proj` (E, C, H), each an nn.Linear's weight (out, in).

    `forward(rows, counts)`: each expert's SwiGLU on its own rows, `rows` sorted by expert and
    `counts` how many each takes, as one grouped matmul per weight (`torch._grouped_mm`, on the
    transposed views) where the device takes it, else one matmul an expert. Under expert parallel
    the weights are DTensors split along the experts (`parallel.experts`) and this process
    computes with its own slice."""

    def __init__(self, experts: int, width: int, hidden: int):
        super().__init__()
        self.hidden = hidden
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * hidden, width))
        self.down_proj = nn.Parameter(torch.empty(experts, width, hidden))
        for w, fan_in in ((self.gate_up_proj, width), (self.down_proj, hidden)):
            nn.init.normal_(w, std=1 / math.sqrt(fan_in))

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        gate_up, down = _local(self.gate_up_proj).transpose(1, 2), _local(self.down_proj).transpose(1, 2)
        if _grouped(rows, gate_up, down):
            offs = torch.cumsum(counts, 0).to(torch.int32)
            gate, up = torch._grouped_mm(rows, gate_up, offs=offs).chunk(2, dim=-1)
            return torch._grouped_mm(F.silu(gate) * up, down, offs=offs)
        out = []
        for e, part in enumerate(rows.split(counts.tolist())):
            gate, up = (part @ gate_up[e]).chunk(2, dim=-1)
            out.append((F.silu(gate) * up) @ down[e])
        return torch.cat(out)


def _local(w: torch.Tensor) -> torch.Tensor:
    """This process's experts of a weight: a DTensor's own slice (through autograd), or `w`."""
    from torch.distributed.tensor import DTensor

    return w.to_local() if isinstance(w, DTensor) else w


class SwiGLU(nn.Module):
    """A shared expert: down(silu(gate(x)) · up(x))."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _AddAux(torch.autograd.Function):
    """y unchanged in the forward; in the backward, `aux` gets the gradient 1 (so its own graph
    adds ∂aux/∂ to the router), whatever y's gradient is."""

    @staticmethod
    def forward(ctx, y, aux):
        ctx.save_for_backward(aux)
        # Eager: a view, no copy. Compiled: a copy, as AOTAutograd replays an output that views an
        # input outside its graph, and so skipped this backward (the router's gradient was 1e-3 off).
        return y.clone() if torch.compiler.is_compiling() else y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


def _grouped(rows: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes these: it has one, and every row it reads starts at a
    multiple of 16 bytes (on this CPU it refuses others; a GPU asks bf16 of it too, and so does
    its compiled form, on any device). The weights are transposed views: their rows run along
    their second-last dimension."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if (rows.is_cuda or torch.compiler.is_compiling()) and rows.dtype != torch.bfloat16:
        return False
    sizes = [rows.shape[-1] * rows.element_size()] + [w.shape[-2] * w.element_size() for w in weights]
    return all(n % 16 == 0 for n in sizes)
