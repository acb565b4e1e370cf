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

import torch
import torch.distributed as dist

from brigade.errors import RunError

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


class P2PTransport:
    """Point-to-point between processes. `peers[s]` is the global rank running stage s.

    Receives are posted ahead of time so that a sender finds its receiver ready
    and never waits for it (with gloo, a send to a receiver that has not posted
    yet is only completed later by the sender's I/O thread, which a busy CPU
    delays). A receive ahead of time needs the size: both ends predict that a
    message has the shape of the previous one on the same link. When the
    prediction is wrong, the sender follows the header with a placeholder of
    the predicted size, then the real payload:

        sender   header(shape) [placeholder(predicted)] payload(shape)
        receiver header ──► shape == predicted? payload : drop placeholder, recv payload
    """

    def __init__(self, peers: list[int], device: torch.device, group=None):
        self.peers = peers
        self.device = device
        self.group = group
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self._sent_shape: dict[int, tuple] = {}  # stage -> (dtype, shape) last sent
        self._recv_shape: dict[int, tuple] = {}  # stage -> (dtype, shape) last received
        self._posted: dict[int, tuple] = {}  # stage -> (header work, header, payload work, payload)
        self._remaining: dict[int, int] = {}  # receives still expected this step, per stage

    def begin_step(self, receives: dict[int, int]) -> None:
        """Announce how many messages will come from each stage this step; post the first."""
        self._remaining = dict(receives)
        for stage, n in receives.items():
            if n > 0 and stage not in self._posted:
                self._post(stage)

    def _post(self, stage: int) -> None:
        src = self.peers[stage]
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        h_work = dist.irecv(header, src, group=self.group)
        p_work = payload = None
        if stage in self._recv_shape:
            dtype, shape = self._recv_shape[stage]
            payload = torch.empty(shape, dtype=dtype, device=self.device)
            p_work = dist.irecv(payload, src, group=self.group)
        self._posted[stage] = (h_work, header, p_work, payload)

    def send(self, tensor: torch.Tensor, stage: int) -> None:
        payload = tensor.detach().contiguous()
        key = (payload.dtype, tuple(payload.shape))
        header = torch.tensor(encode_header(payload), dtype=torch.int64, device=self.device)
        messages = [header]
        predicted = self._sent_shape.get(stage)
        if predicted is not None and predicted != key:
            messages.append(torch.zeros(predicted[1], dtype=predicted[0], device=self.device))
        messages.append(payload)
        self._sent_shape[stage] = key
        dst = self.peers[stage]
        # Sends are asynchronous; tensors are kept alive until flush().
        for t in messages:
            self._pending.append((dist.isend(t, dst, group=self.group), t))

    def recv(self, stage: int) -> torch.Tensor:
        if stage not in self._posted:
            self._post(stage)
        h_work, header, p_work, payload = self._posted.pop(stage)
        h_work.wait()
        dtype, shape = decode_header(header.tolist())
        if p_work is not None:
            p_work.wait()
        if payload is None or (payload.dtype, tuple(payload.shape)) != (dtype, shape):
            payload = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(payload, self.peers[stage], group=self.group)
        self._recv_shape[stage] = (dtype, shape)
        left = self._remaining.get(stage, 0) - 1
        self._remaining[stage] = left
        if left > 0:
            self._post(stage)
        return payload

    def flush(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


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
    def __init__(self, hub: LocalTransport, stage: int):
        self.hub, self.stage = hub, stage

    def send(self, tensor: torch.Tensor, stage: int) -> None:
        self.hub.put(self.stage, stage, tensor)

    def recv(self, stage: int) -> torch.Tensor:
        return self.hub.get(stage, self.stage)

    def flush(self) -> None:
        pass
