"""Moving activations and gradients between neighbouring stages.

Two transports share one small interface (`Transport`: `send(action, tensor)`,
`recv(action) -> tensor`, `flush()`), so the runtime does not know which it has. The
action (`0SEND_F3`) names the stage it leaves and, by `ordering.peer_of`, the stage it
goes to; the transport resolves stage → rank or device:

- `p2p.P2PTransport`: one rank per process, torch.distributed point-to-point
  (gloo on CPU, NCCL on GPU), issued as `ordering` decides and `nccl` proves safe.
  Shapes may change between steps and micro-batches; headers (dtype, shape),
  encoded by `wire`, travel only when shapes must be discovered.
- `LocalTransport`: several stages in one process, one thread per device; a
  tensor is handed over through a queue per stage link, copied to the receiver's
  device (on GPUs on a side stream per link, so the copy overlaps compute).
"""

from __future__ import annotations

import queue
import threading
from typing import Protocol

import torch

from brigade.errors import RunError
from brigade.pipeline.plans.action import Action
from brigade.pipeline.stages import structure
from brigade.pipeline.transport.ordering import peer_of


class StageAborted(RunError):
    """This stage stopped because another stage of the same pipeline failed."""


class Transport(Protocol):
    """What the runtime may call; `peers[s]` is the global rank of stage s (None in-process).

    `begin_step` takes this rank's actions for the step and, on the rank of the first stage,
    its micro-batches (a P2P transport decides from their shapes whether to discover shapes).
    `send(a, obj)` hands over the tensor or structure (`structure.flatten`) of comm action `a`
    (a SEND_F or SEND_B, in plan order); `recv(a)` returns what `a` (a RECV_F or RECV_B) carries
    once it arrived, the same structure with its tensors on this end's device; `flush()` waits
    until every send of the step has been handed over.
    """

    peers: list[int] | None

    def begin_step(self, actions: list[Action], inputs: object = None) -> None: ...
    def send(self, a: Action, obj: object) -> None: ...
    def recv(self, a: Action) -> object: ...
    def flush(self) -> None: ...


class LocalTransport:
    """Queues between the device threads of one process; `endpoint(s)` is stage s's view.

    On CPU a tensor is handed over as is (a detached alias: the sender never writes
    it again). When either end is a GPU the copy runs on a side stream of its own
    link (src, dst), so copies overlap compute and a stage's two neighbours never
    queue behind each other's copies. The stream is on the destination when it
    is a GPU (the copy is then allocated on that stream, so the allocator orders
    its reuse after the copy), else on the source:

        producer stream  ──compute──►|                      (wait_stream: copy after it)
        link stream                  └─copy─►event
        consumer stream                        └wait_event──► compute

    `record_stream` keeps the allocator from reusing the source (freed by the
    producer after the hand-off) or the copy (used by the consumer) too early. A
    GPU-to-CPU copy lands in pinned memory; the CPU consumer waits on its event.
    """

    def __init__(self, devices: list[torch.device], timeout_s: float = 300.0):
        self.devices = devices  # stage -> its device
        self.timeout_s = timeout_s
        self.abort = threading.Event()
        n = len(devices)
        self._queues = {(a, b): queue.Queue() for a in range(n) for b in range(n) if abs(a - b) == 1}
        self._links = {link: torch.cuda.Stream(device=self._copier(*link)) for link in self._queues
                       if self._copier(*link) is not None}

    def _copier(self, src: int, dst: int) -> torch.device | None:
        """The device whose stream copies from stage src to dst (None: CPU to CPU)."""
        return next((d for d in (self.devices[dst], self.devices[src]) if d.type == "cuda"), None)

    def endpoint(self) -> LocalEndpoint:
        """A device thread's end: it sends and receives for whichever stages it runs."""
        return LocalEndpoint(self)

    def put(self, src: int, dst: int, obj) -> None:
        """Copy a tensor or structure's tensors towards stage dst (asynchronously on GPUs), queue it.

        Raises:
            StructureError: `obj` holds something that cannot be sent.
        """
        tensors, spec = structure.flatten(obj)
        tensors = [t.detach() for t in tensors]
        stream = self._links.get((src, dst))
        if stream is None:
            moved = [t.to(self.devices[dst]) for t in tensors]
            self._queues[(src, dst)].put((structure.unflatten(moved, spec), None))
            return
        for dev in {t.device for t in tensors if t.is_cuda}:  # the copy sees what the producer queued
            stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            moved = [t.to(self.devices[dst], non_blocking=True) for t in tensors]
            event = torch.cuda.Event()
            event.record(stream)
        for t in tensors:
            if t.is_cuda:
                t.record_stream(stream)  # the producer may free it before the copy ran
        self._queues[(src, dst)].put((structure.unflatten(moved, spec), event))

    def get(self, src: int, dst: int):
        """The next tensor or structure from stage src, ready for stage dst's current stream."""
        q = self._queues[(src, dst)]
        waited = 0.0
        while True:
            if self.abort.is_set():
                raise StageAborted(f"stage {dst}: another stage failed while waiting for stage {src}")
            try:
                tensor, event = q.get(timeout=0.05)
                break
            except queue.Empty:
                waited += 0.05
                if waited > self.timeout_s:
                    msg = f"stage {dst}: nothing from stage {src} in {self.timeout_s:.0f}s"
                    raise RunError(msg) from None
        if event is None:
            return tensor
        if self.devices[dst].type != "cuda":
            event.synchronize()  # pinned host memory written by a GPU copy
            return tensor
        consumer = torch.cuda.current_stream(self.devices[dst])
        consumer.wait_event(event)
        for t in structure.flatten(tensor)[0]:
            t.record_stream(consumer)  # allocated on the link's stream, used on the consumer's
        return tensor


class LocalEndpoint:
    """One device thread's view of a LocalTransport (implements `Transport`), for its stages."""

    peers = None  # all stages are in this process

    def __init__(self, hub: LocalTransport):
        self.hub = hub

    def begin_step(self, actions: list[Action], inputs: object = None) -> None:
        """Nothing to post ahead: a queue hand-off needs no receive in advance."""

    def send(self, a: Action, obj) -> None:
        self.hub.put(a.stage, peer_of(a), obj)

    def recv(self, a: Action):
        return self.hub.get(peer_of(a), a.stage)

    def flush(self) -> None:
        pass
