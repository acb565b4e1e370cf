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

A compiled block (--compile) is one node in the graph whose backward computes every gradient
of the block at once: the input pass would compute its weight gradients and drop them, and the
weight pass compute them all again. So a frontier node that is a compiled graph's
(`_compiled`) is not split: the input pass asks for its parameters too and adds their gradients
at once, and the weight pass only reports them ready. The block's W costs nothing and its I
what its whole backward costs.

Under data parallel, DDP's reducer never fires (it hooks a normal backward), so
`reduce.GradientReducer` takes its place: the runner tells it which parameters the
step's last weight pass has finished, and it all-reduces them in buckets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

Ready = Callable[[list[torch.Tensor]], None]  # told which parameters' gradients are complete


def _walk(roots: list) -> list:
    """Nodes reachable from `roots`, children before parents (post-order)."""
    order, seen, stack = [], set(), [(root, False) for root in reversed(roots)]
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


def _frontier(roots: list, x_nodes: set, param_nodes: dict) -> tuple[dict, set]:
    """{frontier node: indices of the params below its param-only children}, and the roots
    that reach an x. An empty dict with roots means: no clean split (shared weights)."""
    reach_x, below = {}, {}
    for node in _walk(roots):
        kids = [c for c, _ in node.next_functions if c is not None]
        reach_x[node] = node in x_nodes or any(reach_x[c] for c in kids)
        own = {param_nodes[node]} if node in param_nodes else set()
        below[node] = own.union(*(below[c] for c in kids))
    frontier, claimed = {}, set()
    for node, hits_x in reach_x.items():
        if not hits_x:
            continue
        mine = set().union(*(below[c] for c, _ in node.next_functions if c is not None and not reach_x[c]))
        if mine:
            if mine & claimed:
                return {}, {r for r in roots if reach_x.get(r, False)}  # shared weights: no split
            claimed |= mine
            frontier[node] = sorted(mine)
    hits = {r for r in roots if reach_x.get(r, False)}
    return (frontier if frontier or not hits else {}), hits


def _compiled(node) -> bool:
    """A compiled graph's backward (AOTAutograd's node): it cannot leave its weight gradients out."""
    return "CompiledFunctionBackward" in node.name()


def _accumulate(params: list[torch.Tensor], grads) -> None:
    """Add into `.grad` in place, as autograd does: no new tensor per micro-batch."""
    with torch.no_grad():
        for p, g in zip(params, grads):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad += g


def _whole(ys, grads, params) -> Callable[[Ready | None], None]:
    """A weight step with no frontier: every weight gradient in one call."""
    def step(ready: Ready | None = None) -> None:
        if params and ys:
            _accumulate(params, torch.autograd.grad(ys, params, grads, allow_unused=True))
        if ready:
            ready(params)
    return step


def _done(params) -> Callable[[Ready | None], None]:
    """A weight step for gradients the input pass already added (no clean split)."""
    def step(ready: Ready | None = None) -> None:
        if ready:
            ready(params)
    return step


def backward_split(y, grad, x, params: list[torch.Tensor]) -> tuple[Any, Callable[[Ready | None], None]]:
    """Input gradient now; a function that adds the weight gradients to `.grad` later.

    The weight step takes an optional `ready(params)`, called as each group of parameters
    has its gradient added, so a reduction can start before the whole pass is done. A stage
    with several outputs and inputs passes lists (`boundary.backward_pairs` makes ys, grads).

    Args:
        y: this stage's output (or the scaled loss on the last stage), or a list of outputs.
        grad: dL/dy (None for a loss), or a list with one per output.
        x: this stage's input leaf, or None / not requiring grad on the first stage; or a list
            of input leaves.
        params: the stage's parameters.

    Returns:
        (dL/dx, weight_step): dL/dx a tensor (zeros when y does not depend on x) or None
        for one x; for a list, one gradient or None (x unused or not requiring grad) each.
    """
    many = isinstance(x, (list, tuple))
    ys, grads = (list(y), list(grad)) if isinstance(y, (list, tuple)) else ([y], [grad])
    xs = [t for t in (x if many else [x]) if t is not None and t.requires_grad]
    params = [p for p in params if p.requires_grad]
    if not xs or not ys:
        return ([None] * len(x) if many else None), _whole(ys, grads, params)
    dxs, step = _split(ys, grads, xs, params)
    if not many:
        return (torch.zeros_like(x) if dxs[0] is None else dxs[0]), step
    got = dict(zip(map(id, xs), dxs))
    return [got.get(id(t)) for t in x], step


def _split(ys: list, grads: list, xs: list, params: list) -> tuple[list, Callable[[Ready | None], None]]:
    """`backward_split` over lists: xs all require grad; dL/dx is None for an x no y reaches."""
    x_nodes = {get_gradient_edge(t).node for t in xs}
    param_nodes = {get_gradient_edge(p).node: i for i, p in enumerate(params)}
    roots = list(dict.fromkeys(get_gradient_edge(t).node for t in ys))
    frontier, hits = _frontier(roots, x_nodes, param_nodes)
    if hits and not frontier:
        torch.autograd.backward(ys, grads, inputs=[*xs, *params])
        return [t.grad for t in xs], _done(params)
    # Outputs that do not depend on any input: their weight gradients in one call of their own.
    reach = [get_gradient_edge(t).node in hits for t in ys]
    rest = _whole([t for t, r in zip(ys, reach) if not r], [g for g, r in zip(grads, reach) if not r], params)
    if not hits:
        return [None] * len(xs), rest
    ys, grads = [t for t, r in zip(ys, reach) if r], [g for g, r in zip(grads, reach) if r]
    retain = not all(reach)  # the rest's graph may share nodes with the frontier's
    kept: dict = {}

    def keep(node):
        def hook(grad_outputs):
            kept[node] = grad_outputs
        return hook

    whole = [params[i] for n in [n for n in frontier if _compiled(n)] for i in frontier.pop(n)]
    handles = [n.register_prehook(keep(n)) for n in frontier]
    try:
        got = torch.autograd.grad(ys, [*xs, *whole], grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    dxs = list(got[:len(xs)])
    _accumulate(whole, got[len(xs):])  # compiled blocks: their weight gradients with the input's

    def weight_step(ready: Ready | None = None) -> None:
        if ready and whole:
            ready(whole)
        # One call per frontier node, asking only for the parameters below its weight-only
        # children, so no gradient flows twice through the input path.
        for node, outs in kept.items():
            edges = [GradientEdge(node, k) for k, g in enumerate(outs) if g is not None]
            mine = [params[i] for i in frontier[node]]
            if edges:
                grads = [g for g in outs if g is not None]
                _accumulate(mine, torch.autograd.grad(edges, mine, grads, allow_unused=True,
                                                      retain_graph=retain))
            if ready and not retain:
                ready(mine)
        if retain:
            rest(ready)

    return dxs, weight_step
