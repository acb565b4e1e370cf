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


class P2PTransport:
    """Point-to-point between processes. `peers[s]` is the global rank running stage s."""

    def __init__(self, peers: list[int], device: torch.device, group=None):
        self.peers = peers
        self.device = device
        self.group = group
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, tensor: torch.Tensor, stage: int) -> None:
        payload = tensor.detach().contiguous()
        header = torch.tensor(encode_header(payload), dtype=torch.int64, device=self.device)
        dst = self.peers[stage]
        # Sends are asynchronous; tensors are kept alive until flush().
        for t in (header, payload):
            self._pending.append((dist.isend(t, dst, group=self.group), t))

    def recv(self, stage: int) -> torch.Tensor:
        src = self.peers[stage]
        header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, src, group=self.group)
        dtype, shape = decode_header(header.tolist())
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buf, src, group=self.group)
        return buf

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
                raise RunError(f"stage {dst}: another stage failed while waiting for stage {src}")
            try:
                tensor, event = q.get(timeout=0.05)
                break
            except queue.Empty:
                waited += 0.05
                if waited > self.timeout_s:
                    raise RunError(f"stage {dst}: nothing from stage {src} in {self.timeout_s:.0f}s")
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
