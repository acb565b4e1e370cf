"""How many collectives the code inside `Collectives` issued: torch's functional ones, as DTensor
issues them, counted on a fake world (`world.mesh.fake_world`) or a real one alike (`planner.split_costs`,
`measure.gloo_probe`).
"""

from __future__ import annotations

_ISSUED = ("all_", "reduce", "broadcast")  # a collective's ops, not its waits or autograd wrappers


class Collectives:
    """Context manager counting the collectives issued inside it (`n`): torch's functional ones,
    which DTensor issues (not their waits, nor the wrappers that carry them through autograd).
    torch's CommDebugMode counts them too, but its module tracker fails on a block recomputed
    in its backward."""

    def __init__(self):
        self.n = 0
        self._mode = None

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace == "_c10d_functional" and func.__name__.startswith(_ISSUED):
                    counter.n += 1
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
