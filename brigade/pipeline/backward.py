"""Backward in two halves, for zero-bubble schedules: input gradient now, weight gradient later.

The input gradient is what the previous stage waits for; the weight gradient
only this stage needs, before the optimizer step. Splitting them lets a stage
send upstream as early as possible and fill its idle time with weight work.

How, without computing anything twice:

    y ─► … ─► N ─► … ─► x          N: a "frontier" node, on a path to x, with
              └──► T ─► W               a child (T) from which only parameters
                                        are reachable
    1. input pass: autograd.grad(y, x, retain_graph=True). The engine computes
       only what leads to x, so N skips its weight output. A pre-hook on every
       frontier node keeps the gradient that flowed into it.
    2. weight pass: autograd.grad from those frontier nodes (GradientEdge) to the
       parameters, with the kept gradients; each N now computes only its weight
       output. The results are added to `.grad`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


def _walk(root) -> list:
    """Nodes reachable from `root`, children before parents (post-order)."""
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if node is None:
            continue
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((child, False) for child, _ in node.next_functions)
    return order


def _frontier(root, x_node, param_nodes: dict) -> tuple[dict, bool]:
    """{frontier node: indices of the params below its param-only children}, and whether
    `root` reaches x at all. Empty dict with True means: no clean split (shared weights)."""
    reach_x, below = {}, {}
    for node in _walk(root):
        kids = [c for c, _ in node.next_functions if c is not None]
        reach_x[node] = node is x_node or any(reach_x[c] for c in kids)
        own = {param_nodes[node]} if node in param_nodes else set()
        below[node] = own.union(*(below[c] for c in kids))
    frontier, claimed = {}, set()
    for node, hits_x in reach_x.items():
        if not hits_x:
            continue
        mine = set().union(*(below[c] for c, _ in node.next_functions if c is not None and not reach_x[c]))
        if mine:
            if mine & claimed:
                return {}, True  # a parameter under two frontier nodes: do not split
            claimed |= mine
            frontier[node] = sorted(mine)
    return frontier, reach_x.get(root, False)


def _accumulate(params: list[torch.Tensor], grads) -> None:
    for p, g in zip(params, grads):
        if g is not None:
            p.grad = g if p.grad is None else p.grad + g


def backward_split(y: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None,
                   params: list[torch.Tensor]) -> tuple[torch.Tensor | None, Callable[[], None]]:
    """Input gradient now; a function that adds the weight gradients to `.grad` later.

    Args:
        y: this stage's output (or the scaled loss on the last stage); grad: dL/dy (None for a loss).
        x: this stage's input leaf, or None / not requiring grad on the first stage.
        params: the stage's parameters.

    Returns:
        (dL/dx or None, weight_step).
    """
    params = [p for p in params if p.requires_grad]
    if x is None or not x.requires_grad:
        return None, lambda: _accumulate(params, torch.autograd.grad(y, params, grad, allow_unused=True))
    x_node = get_gradient_edge(x).node
    param_nodes = {get_gradient_edge(p).node: i for i, p in enumerate(params)}
    frontier, reaches_x = _frontier(y.grad_fn, x_node, param_nodes)
    if reaches_x and not frontier:
        torch.autograd.backward(y, grad, inputs=[x, *params])
        return x.grad, lambda: None
    if not reaches_x:
        dx = torch.zeros_like(x)
        return dx, lambda: _accumulate(params, torch.autograd.grad(y, params, grad, allow_unused=True))
    kept: dict = {}

    def keep(node):
        def hook(grad_outputs):
            kept[node] = grad_outputs
        return hook

    handles = [n.register_prehook(keep(n)) for n in frontier]
    try:
        (dx,) = torch.autograd.grad(y, x, grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()

    def weight_step() -> None:
        # One call per frontier node, asking only for the parameters below its weight-only
        # children, so no gradient flows twice through the input path.
        for node, outs in kept.items():
            edges = [GradientEdge(node, k) for k, g in enumerate(outs) if g is not None]
            if not edges:
                continue
            mine = [params[i] for i in frontier[node]]
            grads = [g for g in outs if g is not None]
            _accumulate(mine, torch.autograd.grad(edges, mine, grads, allow_unused=True))

    return dx, weight_step
