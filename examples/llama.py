"""A Llama-style decoder as brigade blocks: RMSNorm, rotary embeddings at each token's position (a
side input), grouped-query causal attention, SwiGLU, and a head tied to the embedding.

    brigade check --model examples/llama.py:model --stages 2

Shapes: B batch, T time, C n_embd, H n_head, K n_kv_head, D head size, V vocab_size.
Nothing here knows about parallelism: the blocks declare the side input they take, and the
head shares the embedding's weight; brigade delivers the positions and keeps the copies equal.
Under context parallel (--cp) brigade cuts the positions with the tokens, so each part of a
sequence rotates by its global positions, and routes the causal attention over the parts.
Attention is causal without a mask: data that pads a row pads its end, where no real token
looks, and gives the pads' targets IGNORE, which the loss skips. Each
block also declares how tensor parallel (--tp) may split it (`tp_plan`): q, the fused k/v and
the SwiGLU's gate and up column-wise, by whole heads; the attention output and down row-wise;
the two norms on a part of the sequence (sequence parallel, where x is (B, T/tp, C)). Attention
reads how many heads it holds, and the sequence's length, from q's shape.
"""

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100  # target at a padded position: no loss there


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # (..., C) -> (..., C)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x, cos, sin):  # (B, H, T, D), (B, 1, T, D/2) -> (B, H, T, D): rotate pairs by position
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Embed(nn.Module):
    tp_plan: dict = {}  # whole on every tensor-parallel process

    def __init__(self, vocab_size: int, n_embd: int):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)

    def forward(self, tokens):  # (B, T) int64 -> (B, T, C)
        return self.tok(tokens)


class Decoder(nn.Module):
    side_inputs = ("positions",)  # brigade hands it to forward, from the batch

    def __init__(self, n_embd: int, n_head: int, n_kv_head: int, block_size: int, theta: float = 10000.0):
        super().__init__()
        self.n_head, self.n_kv_head, self.d = n_head, n_kv_head, n_embd // n_head
        self.attn_norm, self.mlp_norm = RMSNorm(n_embd), RMSNorm(n_embd)
        self.q = nn.Linear(n_embd, n_head * self.d, bias=False)
        self.kv = nn.Linear(n_embd, 2 * n_kv_head * self.d, bias=False)
        self.o = nn.Linear(n_head * self.d, n_embd, bias=False)
        hidden = 64 * ((8 * n_embd // 3 + 63) // 64)
        self.gate, self.up = nn.Linear(n_embd, hidden, bias=False), nn.Linear(n_embd, hidden, bias=False)
        self.down = nn.Linear(hidden, n_embd, bias=False)
        self.tp_plan = {"q": ("colwise", n_head), "kv": ("colwise", n_kv_head), "o": ("rowwise", n_head),
                        "gate": "colwise", "up": "colwise", "down": "rowwise",
                        "attn_norm": "sequence", "mlp_norm": "sequence"}
        angles = torch.outer(torch.arange(block_size), theta ** (-torch.arange(0, self.d, 2) / self.d))
        self.register_buffer("cos", angles.cos(), persistent=False)  # (block_size, D/2)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x, *, positions):  # (B, T, C), (B, T) int64 -> (B, T, C)
        h = self.attn_norm(x)
        q = self.q(h)  # (B, T, H * D): the whole sequence even where x holds a part of it
        b, t, _ = q.shape
        q = q.view(b, t, -1, self.d).transpose(1, 2)  # (B, H, T, D); H: the heads held here
        # Rows of kv are head-major, each head's k and v adjacent: a split hands out whole heads.
        kv = self.kv(h).view(b, t, -1, 2, self.d)  # (B, T, K, 2, D)
        k, v = (kv[..., i, :].transpose(1, 2) for i in range(2))  # (B, K, T, D) each
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # (B, 1, T, D/2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k, v = (z.repeat_interleave(self.n_head // self.n_kv_head, dim=1) for z in (k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Head(nn.Module):
    tp_plan: dict = {}  # whole on every tensor-parallel process: the loss sees whole logits

    def __init__(self, embed: Embed):
        super().__init__()
        self.norm = RMSNorm(embed.tok.embedding_dim)
        self.out = nn.Linear(embed.tok.embedding_dim, embed.tok.num_embeddings, bias=False)
        self.out.weight = embed.tok.weight  # tied: one parameter on two blocks

    def forward(self, x):  # (B, T, C) -> (B, T, V)
        return self.out(self.norm(x))


def model(vocab_size: int = 96, block_size: int = 32, n_layer: int = 4, n_embd: int = 64,
          n_head: int = 4, n_kv_head: int = 2) -> list[nn.Module]:
    """[Embed, Decoder × n_layer, Head], the head tied to the embedding."""
    if n_embd % n_head or n_head % n_kv_head or (n_embd // n_head) % 2:
        raise ValueError(f"n_embd={n_embd}, n_head={n_head}, n_kv_head={n_kv_head}: need n_head | n_embd, "
                         "n_kv_head | n_head and an even head size")
    embed = Embed(vocab_size, n_embd)
    blocks = [embed, *(Decoder(n_embd, n_head, n_kv_head, block_size) for _ in range(n_layer))]
    for m in nn.ModuleList(blocks).modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
    return [*blocks, Head(embed)]


def batch(n: int, generator: torch.Generator, vocab_size: int = 96, block_size: int = 32):
    """Counting sequences ((start + i) mod V), each `block_size` long: learnable."""
    start = torch.randint(vocab_size, (n, 1), generator=generator)
    seq = (start + torch.arange(block_size + 1)) % vocab_size  # (B, T + 1)
    return text_inputs(seq[:, :-1]), seq[:, 1:]


def text_inputs(tokens):  # (B, T) int64 -> the inputs model() takes; also used with --data FILE
    """Token ids as inputs, with each token's position in its row."""
    return {"tokens": tokens, "positions": torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1)}


def loss(logits, targets):  # (B, T, V), (B, T) -> scalar
    """Mean over sequences of each sequence's mean over its real tokens.

    Per sequence first, so a micro-batch's loss weighted by its share of the batch sums to the
    batch's loss, however the padding falls.
    """
    per_token = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")
    real = (targets != IGNORE).float()  # (B, T)
    return ((per_token * real).sum(1) / real.sum(1).clamp(min=1)).mean()
