"""Moving activations and gradients between neighbouring stages.

Two transports share one small interface (`send(tensor, stage)`,
`recv(stage) -> tensor`, `flush()`), so the runtime does not know which it has:

- `P2PTransport`: one stage per process, torch.distributed point-to-point
  (gloo on CPU, NCCL on GPU). Every message is a fixed-size header (dtype and
  shape) followed by the payload, so shapes may change between micro-batches.
- `LocalTransport`: several stages in one process, one thread per device; a
  tensor is handed over through a queue, copied to the receiver's device (on
  GPUs on a side stream, so the copy overlaps compute).
"""

from __future__ import annotations

import queue
import threading
from typing import Protocol

import torch
import torch.distributed as dist

from brigade.errors import RunError
from brigade.pipeline.ordering import BEGIN, EAGER, GROUPED, peer_of, posting
from brigade.pipeline.schedule import COMM_OPS, RECV_F, SEND_B, SEND_F, Action

_DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]
_MAX_DIMS = 8
_HEADER = 2 + _MAX_DIMS


def encode_header(t: torch.Tensor) -> list[int]:
    """[dtype code, ndim, *shape, 0-padding] — what the receiver needs to allocate."""
    if t.dim() > _MAX_DIMS:
        raise ValueError(f"cannot send a {t.dim()}-dimensional tensor: at most {_MAX_DIMS} dims")
    return [_DTYPES.index(t.dtype), t.dim(), *t.shape, *([0] * (_MAX_DIMS - t.dim()))]


def decode_header(header: list[int]) -> tuple[torch.dtype, tuple[int, ...]]:
    code, ndim = header[0], header[1]
    return _DTYPES[code], tuple(header[2 : 2 + ndim])


class StageAborted(RunError):
    """This stage stopped because another stage of the same pipeline failed."""


class Transport(Protocol):
    """What the runtime may call; `peers[s]` is the global rank of stage s (None in-process)."""

    peers: list[int] | None

    def begin_step(self, actions: list[Action]) -> None: ...
    def send(self, tensor: torch.Tensor, stage: int) -> None: ...
    def recv(self, stage: int) -> torch.Tensor: ...
    def flush(self) -> None: ...


class P2PTransport:
    """Point-to-point between processes. `peers[s]` is the global rank running stage s.

    What is issued when is decided by `ordering.posting(actions, policy)`, the
    function `ordering.check` proves deadlock-free:

    - "grouped" (NCCL, which runs a rank's point-to-point ops in issue order):
      each send and the receives up to the next send go into one
      `batch_isend_irecv`, so neighbours that both send before they receive meet.
    - "eager" (gloo, the default there): each receive is posted as soon as the
      previous one from that neighbour arrived, so a sender finds its receiver
      ready (with gloo a send to a receiver that has not posted yet is only
      completed later by the sender's I/O thread, which a busy CPU delays).

    A message is a header (dtype, shape) and the payload. Both ends predict a
    message's shape as that of the same micro-batch on the same link in an
    earlier step, so the receiver posts header and payload together. When the
    prediction is missing or wrong the sender follows the header with a
    placeholder of the predicted size, then the payload in a batch of its own:

        sender   [header (placeholder)] [payload]
        receiver [header (predicted)]  read header ─► wrong? [recv payload]

    Host synchronisation: the sender keeps one device header per shape (no
    host-to-device copy per message); the receiver waits for the payload on its
    compute stream, and reads only the header on the host, on a side stream
    into pinned memory, so it waits for that header's arrival, not for the
    device's queue. Late payloads (a first step, a changed shape) are correct
    on gloo; `ordering.issued(..., mispredicted=True)` shows that NCCL may
    deadlock on them, so under NCCL shapes must repeat from step to step.
    """

    def __init__(self, peers: list[int], device: torch.device, group=None, policy: str | None = None):
        self.peers = peers
        self.device = device
        self.group = group
        self.policy = policy or (GROUPED if dist.get_backend(group) == "nccl" else EAGER)
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        self._known: dict[tuple[int, str, int], tuple] = {}  # (peer, F|B, mb) -> (dtype, shape)
        self._headers: dict[tuple, torch.Tensor] = {}  # (dtype, shape) -> header on device
        self._staged: dict[Action, tuple[list, list]] = {}  # send -> (in-batch parts, late parts)
        self._posted: dict[Action, tuple] = {}  # recv -> (ops, header, payload, predicted)
        self._recv_works: dict[int, dist.Work] = {}  # id(P2POp) -> its work
        self._comms: list[Action] = []
        self._issues: dict[int, list[tuple[Action, ...]]] = {}
        self._next = 0
        self._meta = None
        if device.type == "cuda":
            self._meta = torch.cuda.Stream(device=device)
            self._pinned = torch.empty(_HEADER, dtype=torch.int64, pin_memory=True)

    def begin_step(self, actions: list[Action]) -> None:
        """Take this rank's actions (with comms) for the step; issue what comes first."""
        self._comms = [a for a in actions if a.op in COMM_OPS]
        self._issues = {}
        for issue in posting(actions, self.policy):
            self._issues.setdefault(issue.after, []).append(issue.ops)
        self._next = 0
        self._issue_after(BEGIN)

    def _expect(self, stage: int, sending: bool) -> Action:
        if self._next >= len(self._comms):
            raise RunError(f"transport: unexpected message with stage {stage}: begin_step lists no more")
        a = self._comms[self._next]
        if peer_of(a) != stage or (a.op in (SEND_F, SEND_B)) != sending:
            raise RunError(f"transport: {'send to' if sending else 'recv from'} stage {stage} "
                           f"where the plan has {a}")
        return a

    def _key(self, a: Action) -> tuple[int, str, int]:
        return peer_of(a), "F" if a.op in (SEND_F, RECV_F) else "B", a.microbatch

    def _issue_after(self, k: int) -> None:
        for batch in self._issues.pop(k, []):
            ops, late = [], []
            for a in batch:
                if a in self._staged:
                    parts, tail = self._staged.pop(a)
                    ops += [dist.P2POp(dist.isend, t, self.peers[peer_of(a)], self.group) for t in parts]
                    late += [(a, t) for t in tail]
                else:
                    ops += self._post(a)
            self._start(ops)
            for a, t in late:
                self._start([dist.P2POp(dist.isend, t, self.peers[peer_of(a)], self.group)])

    def _start(self, ops: list) -> list:
        works = dist.batch_isend_irecv(ops)
        for op, work in zip(ops, works):
            if op.op is dist.isend:
                self._sends.append((work, op.tensor))  # kept alive until flush()
            else:
                self._recv_works[id(op)] = work
        return works

    def _read_header(self, work: dist.Work, header: torch.Tensor) -> list[int]:
        if self._meta is None:
            work.wait()
            return header.tolist()
        # Only a side stream waits for the header; the compute stream's queue is not drained.
        with torch.cuda.stream(self._meta):
            work.wait()
            self._pinned.copy_(header, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(self._meta)
        header.record_stream(self._meta)
        arrived.synchronize()
        return self._pinned.tolist()

    def _post(self, a: Action) -> list:
        src = self.peers[peer_of(a)]
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        predicted = self._known.get(self._key(a))
        tensors = [header]
        if predicted is not None:
            tensors.append(torch.empty(predicted[1], dtype=predicted[0], device=self.device))
        ops = [dist.P2POp(dist.irecv, t, src, self.group) for t in tensors]
        self._posted[a] = (ops, header, tensors[1] if predicted else None, predicted)
        return ops

    def send(self, tensor: torch.Tensor, stage: int) -> None:
        """Hand `tensor` to the neighbour running `stage` (asynchronous until flush())."""
        a = self._expect(stage, sending=True)
        payload = tensor.detach().contiguous()
        key = (payload.dtype, tuple(payload.shape))
        header = self._headers.get(key)
        if header is None:
            header = torch.tensor(encode_header(payload), dtype=torch.int64, device=self.device)
            self._headers[key] = header
        predicted = self._known.get(self._key(a))
        self._known[self._key(a)] = key
        if predicted == key:
            self._staged[a] = ([header, payload], [])
        else:
            placeholder = [torch.zeros(predicted[1], dtype=predicted[0], device=self.device)] \
                if predicted else []
            self._staged[a] = ([header, *placeholder], [payload])
        self._issue_after(self._next)
        self._next += 1

    def recv(self, stage: int) -> torch.Tensor:
        """The next message from the neighbour running `stage`."""
        a = self._expect(stage, sending=False)
        ops, header, payload, predicted = self._posted.pop(a)
        works = [self._recv_works.pop(id(op)) for op in ops]
        dtype, shape = decode_header(self._read_header(works[0], header))
        if predicted == (dtype, tuple(shape)):
            works[1].wait()
        else:
            for w in works[1:]:
                w.wait()  # the placeholder
            payload = torch.empty(shape, dtype=dtype, device=self.device)
            self._start([dist.P2POp(dist.irecv, payload, self.peers[stage], self.group)])[0].wait()
        self._known[self._key(a)] = (dtype, tuple(shape))
        self._issue_after(self._next)
        self._next += 1
        return payload

    def flush(self) -> None:
        """Wait until every send of this step has been handed over."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

class LocalTransport:
    """Queues between the device threads of one process; `endpoint(s)` is stage s's view."""

    def __init__(self, devices: list[torch.device], timeout_s: float = 300.0):
        self.devices = devices
        self.timeout_s = timeout_s
        self.abort = threading.Event()
        n = len(devices)
        self._queues = {(a, b): queue.Queue() for a in range(n) for b in range(n) if abs(a - b) == 1}
        self._copy_streams = {
            i: torch.cuda.Stream(device=d) for i, d in enumerate(devices) if d.type == "cuda"
        }

    def endpoint(self, stage: int) -> LocalEndpoint:
        return LocalEndpoint(self, stage)

    def put(self, src: int, dst: int, tensor: torch.Tensor) -> None:
        tensor = tensor.detach()
        device = self.devices[dst]
        event = None
        if device.type == "cuda":
            stream = self._copy_streams[dst]
            if tensor.is_cuda:
                stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                moved = tensor.to(device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            if tensor.is_cuda:
                tensor.record_stream(stream)
        else:
            # Same CPU device: a detached alias is safe, the sender never writes it again.
            moved = tensor.to(device)
        self._queues[(src, dst)].put((moved, event))

    def get(self, src: int, dst: int) -> torch.Tensor:
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
        if event is not None:
            torch.cuda.current_stream(tensor.device).wait_event(event)
            tensor.record_stream(torch.cuda.current_stream(tensor.device))
        return tensor


class LocalEndpoint:
    """Stage `stage`'s view of a LocalTransport (implements `Transport`)."""

    peers = None  # all stages are in this process

    def __init__(self, hub: LocalTransport, stage: int):
        self.hub, self.stage = hub, stage

    def begin_step(self, actions: list[Action]) -> None:
        """Nothing to post ahead: a queue hand-off needs no receive in advance."""

    def send(self, tensor: torch.Tensor, stage: int) -> None:
        self.hub.put(self.stage, stage, tensor)

    def recv(self, stage: int) -> torch.Tensor:
        return self.hub.get(stage, self.stage)

    def flush(self) -> None:
        pass
