"""Random draws that do not depend on thread timing, for device threads that share a generator.

A `LocalPipeline` runs one thread per device. On GPUs each device draws from a generator of its
own, in its thread's plan order, so a run repeats bit for bit. On the CPU every "device" is the
CPU, and the process has one CPU generator: the threads' dropout masks came out of it in
whichever order the threads happened to reach their dropouts, and two identical runs parted
within a few steps. The same holds for two ranks placed on one GPU.

So each forward of (stage s, micro-batch i) draws from a stream of its own, seeded from
(the call's base, s, i). A training step's base is one number drawn from the process's CPU
generator in the calling thread before the device threads start, so the per-rank RNG state a
snapshot saves (`brigade.snapshot.rng`) carries every later mask across a resume, with no new
field in the snapshot; evaluation and inference derive theirs from that state without advancing
it (a resumed run does not repeat the evaluation its snapshot preceded). A stage's masks depend
on (step, stage, micro-batch) only: not on the threads, nor on the schedule's order.

How: a forward that draws runs under a `TorchDispatchMode` (thread-local: it sees only its own
thread's operations). An operation tagged `nondeterministic_seeded` (bernoulli_, rand,
native_dropout...) runs under one lock with the shared generators set to the forward's stream,
which is saved back before the process's states are restored:

    thread 0   F(s0,mb1) ─linear─[lock: stream(0,1) in · bernoulli_ · saved · process state back]─gelu─
    thread 1   F(s1,mb0) ─linear──────────────────────────────────────────[lock: stream(1,0) ...]─

Only that operation holds the lock, never a whole forward: a forward may wait in a collective
(DDP's buffer broadcast, tensor parallelism) for a peer process whose thread would wait on the
lock. The mode costs a Python call per operation, so it is paid only where draws happen: a
stage's first forward in each train/eval setting of its modules is watched whole and tells which
of its modules drew from a shared generator (dropout 0, eval mode, or a GPU stage whose generator
is its own: none). Later forwards run bare but for those modules, which hooks put under the
forward's stream (the whole forward where the loss drew). A call that left a shared generator
moved anyway (a module that draws only on some calls) is caught at its end: from then on every
forward is watched whole, and a warning says so. Autograd keeps each mask for the backward, so a
backward (split into I and W or not) draws nothing; a recompute wrapper would have to redraw
inside the same stream.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import warnings
from collections import Counter
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

_SEEDED: dict = {}  # operation -> whether it is tagged nondeterministic_seeded (asked once each)


def _seeded(func) -> bool:
    seeded = _SEEDED.get(func)
    if seeded is None:
        seeded = _SEEDED[func] = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
    return seeded


def shared_generators(devices: list[torch.device]) -> list[torch.Generator]:
    """The generators more than one device thread may draw from: the CPU's whenever there are
    several threads (each may run CPU operations), and that of a GPU several ranks sit on."""
    if len(devices) < 2:
        return []
    gens = [torch.default_generator]
    for device, n in Counter(d for d in devices if d.type == "cuda").items():
        if n > 1:
            torch.cuda.init()  # fills torch.cuda.default_generators
            gens.append(torch.cuda.default_generators[device.index if device.index is not None
                                                      else torch.cuda.current_device()])
    return gens


def own_generators(device: torch.device) -> list[torch.Generator]:
    """The generators a process's forwards draw from on `device`: the CPU's, and its GPU's."""
    if device.type != "cuda":
        return [torch.default_generator]
    torch.cuda.init()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return [torch.default_generator, torch.cuda.default_generators[index]]


def _mix(*parts) -> int:
    """A 63-bit seed from `parts`, mixed into its low 32 bits too (the CPU's mt19937 keeps those)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


_here = threading.local()  # .section: the hook-scoped _Stream of the forward this thread runs


class StageRandom:
    """The random streams of one LocalPipeline's forwards (see the module docstring).

    `begin(training)` and `end()` bracket each call in the calling thread; each device thread
    runs a forward inside `forward(stage, microbatch, module)`; `close()` removes the hooks.

    Args:
        devices: each rank's (thread's) device, in rank order.
        order_free: one thread runs several stages in an order that may change from step to step
            (a plan generated from measured costs): its draws are taken per forward as well, from
            the CPU's generator and its device's.
    """

    def __init__(self, devices: list[torch.device], order_free: bool = False):
        self.generators = shared_generators(devices) if not order_free else own_generators(devices[0])
        self.lock = threading.Lock()  # held by one seeded operation at a time, never by a forward
        self.watch_all = False  # a call drew outside the modules found: watch every forward whole
        # (stage, its modules' training flags) -> the modules that drew (None: outside any, the loss)
        self._scopes: dict[tuple, frozenset] = {}
        self._hooks: dict[nn.Module, list] = {}  # a module that draws -> its scope hooks' handles
        self._base = 0
        self._since_step = 0  # calls since the last training step (evaluations, inference)
        self._outer: list[torch.Tensor] = []

    def begin(self, training: bool) -> None:
        """Fix this call's base, before its threads start: drawn for a training step, derived
        from the generator's state (left as it is) for evaluation and inference."""
        if not self.generators:
            return
        if training:
            self._since_step = 0
            self._base = int(torch.randint(0, 2**62, (), generator=torch.default_generator))
        else:
            self._since_step += 1
            state = torch.default_generator.get_state().numpy().tobytes()
            self._base = _mix(hashlib.blake2b(state, digest_size=8).hexdigest(), self._since_step)
        self._outer = [g.get_state() for g in self.generators]

    def end(self) -> None:
        """After the call's threads are done: a shared generator that moved was drawn from
        outside the modules found; from now on every forward is watched whole (said once)."""
        if not self.generators or all(torch.equal(g.get_state(), s)
                                      for g, s in zip(self.generators, self._outer)):
            return
        if not self.watch_all:
            warnings.warn("a pipeline stage drew random numbers outside the modules its first forward "
                          "drew in: this step's draws depended on thread timing; every forward is "
                          "watched whole from now on", RuntimeWarning, stacklevel=4)
        self.watch_all = True

    def forward(self, stage: int, microbatch: int, module: nn.Module):
        """The context of one forward of (stage, micro-batch) on its device thread."""
        if not self.generators:
            return contextlib.nullcontext()
        key = (stage, tuple(m.training for m in module.modules()))
        scope = self._scopes.get(key)
        seed = _mix(self._base, stage, microbatch)
        if self.watch_all or (scope is not None and None in scope):
            return _Stream(self, seed)
        if scope is None:
            return self._probe(key, module, seed)
        return self._scoped(_Stream(self, seed, scope)) if scope else contextlib.nullcontext()

    def close(self) -> None:
        """Remove the hooks from the modules that draw."""
        for handles in self._hooks.values():
            for handle in handles:
                handle.remove()
        self._hooks.clear()

    @contextlib.contextmanager
    def _probe(self, key: tuple, root: nn.Module, seed: int) -> Iterator[None]:
        """A first forward, watched whole, that finds the modules drawing from a shared generator."""
        section = _Stream(self, seed, probe=True)

        def enter(m, args) -> None:
            section.stack.append(m)

        def leave(m, args, output) -> None:  # None: the output stays as it is
            section.stack.pop()

        handles = [h for m in root.modules() for h in (
            m.register_forward_pre_hook(enter), m.register_forward_hook(leave, always_call=True))]
        try:
            with section:
                yield
        finally:
            for h in handles:
                h.remove()
        self._scopes[key] = frozenset(section.drawn)
        for m in section.drawn - {None}:
            if m not in self._hooks:
                self._hooks[m] = [m.register_forward_pre_hook(_enter_scope),
                                  m.register_forward_hook(_leave_scope, always_call=True)]

    @staticmethod
    @contextlib.contextmanager
    def _scoped(section: _Stream) -> Iterator[None]:
        """A forward whose drawing modules enter `section` themselves (`_enter_scope`)."""
        _here.section = section
        try:
            yield
        finally:
            _here.section = None


def _enter_scope(module: nn.Module, args) -> None:
    section = getattr(_here, "section", None)
    if section is not None and module in section.scope:
        section.depth += 1
        if section.depth == 1:
            section.__enter__()


def _leave_scope(module: nn.Module, args, output) -> None:
    section = getattr(_here, "section", None)
    if section is not None and module in section.scope:
        section.depth -= 1
        if section.depth == 0:
            section.__exit__(None, None, None)


class _Stream(TorchDispatchMode):
    """One forward's stream: its seeded operations run on it, one at a time across threads.

    Args:
        scope: the modules that enter it (hook-scoped); probe: record which module drew.
    """

    def __init__(self, owner: StageRandom, seed: int, scope: frozenset = frozenset(), probe: bool = False):
        super().__init__()
        self.owner, self.seed, self.scope, self.probe = owner, seed, scope, probe
        self.states: list[torch.Tensor] | None = None  # the stream, after its latest draw
        self.depth = 0  # scope modules entered and not yet left
        self.stack: list[nn.Module] = []  # (probe) the modules running, innermost last
        self.drawn: set = set()  # (probe) the innermost module of each draw (None: outside them)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _seeded(func):
            return func(*args, **kwargs)
        gens = self.owner.generators
        with self.owner.lock:
            outer = [g.get_state() for g in gens]
            for k, g in enumerate(gens):
                if self.states is None:
                    g.manual_seed(self.seed)
                else:
                    g.set_state(self.states[k])
            before = [g.get_state() for g in gens] if self.probe else None
            try:
                return func(*args, **kwargs)
            finally:
                self.states = [g.get_state() for g in gens]
                if before is not None and not all(torch.equal(a, b) for a, b in zip(before, self.states)):
                    self.drawn.add(self.stack[-1] if self.stack else None)
                for g, state in zip(gens, outer):
                    g.set_state(state)
