"""The tutorial's ToyModel (Linear 10→10, ReLU, Linear 10→5), and a deep MLP for benchmarks."""

from __future__ import annotations

from torch import nn


def toy() -> list[nn.Module]:
    """(B, 10) -> (B, 5), as three blocks."""
    return [nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)]


def mlp(width: int = 1024, depth: int = 8) -> list[nn.Module]:
    """`depth` blocks of Linear(width, width) + ReLU: (B, width) -> (B, width)."""
    return [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)]
