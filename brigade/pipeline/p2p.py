"""Point-to-point transport between processes (one rank per process), gloo or NCCL.

A rank may hold several stages; `peers[s]` is the global rank of stage s, and a message
is matched by its link: on gloo each stage link and direction has its own tag (so two
links between the same pair of ranks never take each other's messages); NCCL has no
tags and pairs messages by order per pair of ranks, which `nccl.check` proves right.

What is issued when is decided in `ordering`, and `nccl` proves it deadlock-free
under NCCL's rules (`nccl.check`); `P2PTransport` only carries it out. The
policy comes from `ordering.policy_for` (one place): "grouped" under NCCL,
"eager" on gloo, `BRIGADE_P2P_POLICY` forces one (e.g. grouped on gloo in tests).

grouped (NCCL): every rank runs a step in one mode, which the first stage picks
and broadcasts at `begin_step` (a one-element tensor on this process's device;
each rank reads it: one host synchronisation per step):

    predicted  batches of `ordering.posting`; payloads only, each receive sized as
               the same (link, direction, micro-batch) in the previous step. No
               header, no host synchronisation per message.
    discovery  first step, or the first stage's input dtypes/shapes (or plan)
               changed, or shapes="dynamic": `nccl.discovery_batches`, each as
               [headers] ─host reads received headers─► [payloads]. The shapes seen
               become the next step's predictions.

Assumption: every message's dtype and shape are a function of the plan and of
the micro-batches' input dtypes and shapes. A model whose shapes depend on
values must pass shapes="dynamic" (discovery every step); a send whose shape
differs from its prediction in predicted mode is refused with that advice.

eager (gloo): each receive is posted as soon as the previous one from that
neighbour arrived, as a header and a payload of the predicted size; when the
prediction is missing or wrong the sender follows the header with a placeholder
of the predicted size, then the payload in a batch of its own:

    sender   [header (placeholder)] [payload]
    receiver [header (predicted)]  read header ─► wrong? [recv payload]

Gloo buffers a send whose receive is not posted yet, so this never deadlocks
there; under NCCL it would (`nccl.check(plan, "eager")`), so it is refused.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from brigade.errors import RunError
from brigade.pipeline.nccl import discovery_batches
from brigade.pipeline.ordering import (
    BEGIN,
    DISCOVERY,
    GROUPED,
    POLICY_ENV,
    PREDICTED,
    STATIC,
    Issue,
    mode_for,
    peer_of,
    policy_for,
    posting,
)
from brigade.pipeline.schedule import COMM_OPS, RECV_F, SEND_B, SEND_F, Action, Plan
from brigade.pipeline.transport import HEADER_LEN, decode_header, encode_header

Shape = tuple[torch.dtype, tuple[int, ...]]


class P2PTransport:
    """Point-to-point between processes; `peers[s]` is the global rank running stage s.

    Args:
        peers: global rank of each stage. device: this process's device.
        group: the pipeline's process group (default: the world).
        policy: "grouped" or "eager"; None: `BRIGADE_P2P_POLICY`, else the backend's default.
        plans: every plan (all ranks, with comms) this transport will run: discovery
            mode cuts batches by the rounds of the whole plan (`nccl.discovery_batches`).
        shapes: "static" (shapes follow input shapes) or "dynamic" (discover every step).

    Raises:
        PlanError: an unknown policy or shapes value, or eager under NCCL.
    """

    def __init__(self, peers: list[int], device: torch.device, group=None, policy: str | None = None,
                 plans: Sequence[Plan] = (), shapes: str = STATIC):
        self.peers = peers
        self.device = device
        self.group = group
        self.policy = policy_for(dist.get_backend(group), policy or os.environ.get(POLICY_ENV))
        mode_for(None, None, shapes)  # validates `shapes`
        self.shapes = shapes
        self.rank = dist.get_rank(group) if group is not None else dist.get_rank()
        self.first = peers[0] == dist.get_rank()  # holds stage 0: picks each step's mode
        self.tags = dist.get_backend(group) != "nccl"
        self.plans = list(plans)
        self._cuts: dict[tuple[int, str], list[Issue]] = {}  # (plan index, mode) -> its batches
        self.mode = PREDICTED  # this step's mode (grouped policy)
        self._last_key = None  # first stage: previous step's (plan, input shapes)
        self._flag = torch.zeros(1, dtype=torch.int64, device=device)
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        self._known: dict[tuple[int, int, str, int], Shape] = {}  # (stage, peer, F|B, mb) -> shape
        self._headers: dict[Shape, torch.Tensor] = {}  # (dtype, shape) -> header on device
        self._staged: dict[Action, torch.Tensor] = {}  # send -> payload, until its batch is issued
        self._posted: dict[Action, tuple] = {}  # recv -> policy-specific receive state
        self._comms: list[Action] = []
        self._issues: dict[int, list[tuple[Action, ...]]] = {}
        self._next = 0

    def begin_step(self, actions: list[Action], inputs: list[torch.Tensor] | None = None) -> None:
        """Take this rank's actions (with comms) for the step; issue what comes first.

        Args:
            actions: this rank's actions. inputs: the micro-batches (first stage only).
        """
        self._comms = [a for a in actions if a.op in COMM_OPS]
        if self.policy == GROUPED:
            self.mode = self._agree_mode(actions, inputs)
        self._issues = {}
        for issue in self._batches(actions):
            self._issues.setdefault(issue.after, []).append(issue.ops)
        self._next = 0
        self._issue_after(BEGIN)

    def _agree_mode(self, actions: list[Action], inputs: list[torch.Tensor] | None) -> str:
        if len(set(self.peers)) == 1:
            return PREDICTED  # nothing to send
        if self.first:
            key = (tuple(actions), tuple((x.dtype, tuple(x.shape)) for x in inputs or ()))
            mode = mode_for(self._last_key, key, self.shapes)
            self._last_key = key
            self._flag.fill_(int(mode == PREDICTED))  # no host sync: a kernel on the device
        dist.broadcast(self._flag, self.peers[0], group=self.group)
        if self.first:
            return mode
        return PREDICTED if self._flag.item() else DISCOVERY  # the step's one host sync

    def _batches(self, actions: list[Action]) -> list[Issue]:
        """This step's batches (`ordering`); grouped ones need the whole plan, simulated once."""
        if self.policy != GROUPED:
            return posting({self.rank: actions}, self.rank, self.policy)
        k = next((k for k, plan in enumerate(self.plans) if plan.get(self.rank) == actions), None)
        if k is None:
            raise RunError(f"rank {self.rank}: the grouped policy orders messages over the whole "
                           "plan; pass it in P2PTransport(plans=...) (Pipeline does)")
        if (k, self.mode) not in self._cuts:
            plan = self.plans[k]
            self._cuts[(k, self.mode)] = posting(plan, self.rank, GROUPED) if self.mode == PREDICTED \
                else discovery_batches(plan, self.rank)
        return self._cuts[(k, self.mode)]

    def _expect(self, a: Action) -> Action:
        if self._next >= len(self._comms):
            raise RunError(f"transport: unexpected {a}: begin_step lists no more messages")
        if self._comms[self._next] != a:
            raise RunError(f"transport: {a} where the plan has {self._comms[self._next]}")
        return a

    def _key(self, a: Action) -> tuple[int, int, str, int]:
        return a.stage, peer_of(a), "F" if a.op in (SEND_F, RECV_F) else "B", a.microbatch

    def _op(self, a: Action, t: torch.Tensor) -> dist.P2POp:
        fn = dist.isend if a.op in (SEND_F, SEND_B) else dist.irecv
        tag = min(a.stage, peer_of(a)) if self.tags else 0  # the link: its lower stage
        return dist.P2POp(fn, t, self.peers[peer_of(a)], self.group, tag)

    def _start(self, ops: list[dist.P2POp]) -> list[dist.Work]:
        """Issue `ops` as one batch; one work per op (NCCL returns one for the whole group)."""
        works = dist.batch_isend_irecv(ops) if ops else []
        works = works * len(ops) if len(works) == 1 else works
        self._sends += [(w, op.tensor) for op, w in zip(ops, works) if op.op is dist.isend]
        return works  # sends are kept alive until flush()

    def _header(self, shape: Shape) -> torch.Tensor:
        if shape not in self._headers:  # one host-to-device copy per distinct shape
            code = encode_header(torch.empty(shape[1], dtype=shape[0], device="meta"))
            self._headers[shape] = torch.tensor(code, dtype=torch.int64, device=self.device)
        return self._headers[shape]

    def _issue_after(self, k: int) -> None:
        for batch in self._issues.pop(k, []):
            if self.policy != GROUPED:
                self._issue_eager(batch)
            elif self.mode == PREDICTED:
                self._issue_predicted(batch)
            else:
                self._issue_discovery(batch)

    def _issue_predicted(self, batch: tuple[Action, ...]) -> None:
        tensors = []
        for a in batch:
            predicted = self._known.get(self._key(a))
            if a.op in (SEND_F, SEND_B):
                t = self._staged.pop(a)
                if (t.dtype, tuple(t.shape)) != predicted:
                    raise RunError(f"rank {self.rank}: {a} is {t.dtype} {tuple(t.shape)} but was "
                                   f"{predicted} in the previous step with the same input shapes: "
                                   "shapes depend on values here; use shapes='dynamic'")
            elif predicted is None:
                raise RunError(f"rank {self.rank}: no shape known for {a} in a predicted step")
            else:
                t = torch.empty(predicted[1], dtype=predicted[0], device=self.device)
            tensors.append(t)
        works = self._start([self._op(a, t) for a, t in zip(batch, tensors)])
        for a, t, work in zip(batch, tensors, works):
            if a.op not in (SEND_F, SEND_B):
                self._posted[a] = (work, t)

    def _issue_discovery(self, batch: tuple[Action, ...]) -> None:
        sends = [(a, self._staged.pop(a)) for a in batch if a.op in (SEND_F, SEND_B)]
        recvs = [a for a in batch if a.op not in (SEND_F, SEND_B)]
        heads = [torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device) for _ in recvs]
        ops = [self._op(a, self._header((t.dtype, tuple(t.shape)))) for a, t in sends]
        works = self._start(ops + [self._op(a, h) for a, h in zip(recvs, heads)])
        for w in works[len(sends):]:
            w.wait()
        # Read every received header at once: the one host synchronisation of this batch.
        shapes = [decode_header(h) for h in torch.stack(heads).tolist()] if heads else []
        bufs = [torch.empty(s, dtype=d, device=self.device) for d, s in shapes]
        works = self._start([self._op(a, t) for a, t in [*sends, *zip(recvs, bufs)]])
        for a, t in sends:
            self._known[self._key(a)] = (t.dtype, tuple(t.shape))
        for a, buf, work, (d, s) in zip(recvs, bufs, works[len(sends):], shapes):
            self._known[self._key(a)] = (d, tuple(s))
            self._posted[a] = (work, buf)

    def _issue_eager(self, batch: tuple[Action, ...]) -> None:
        for a in batch:
            if a.op not in (SEND_F, SEND_B):
                self._post_eager(a)
                continue
            payload = self._staged.pop(a)
            key = (payload.dtype, tuple(payload.shape))
            predicted = self._known.get(self._key(a))
            self._known[self._key(a)] = key
            if predicted == key:
                self._start([self._op(a, self._header(key)), self._op(a, payload)])
                continue
            placeholder = [torch.zeros(predicted[1], dtype=predicted[0], device=self.device)] \
                if predicted else []
            self._start([self._op(a, t) for t in (self._header(key), *placeholder)])
            self._start([self._op(a, payload)])  # late: sized by the header just sent

    def _post_eager(self, a: Action) -> None:
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
        predicted = self._known.get(self._key(a))
        tensors = [header]
        if predicted is not None:
            tensors.append(torch.empty(predicted[1], dtype=predicted[0], device=self.device))
        works = self._start([self._op(a, t) for t in tensors])
        self._posted[a] = (works, tensors, predicted)

    def _finish_eager(self, a: Action) -> torch.Tensor:
        works, tensors, predicted = self._posted.pop(a)
        works[0].wait()
        dtype, shape = decode_header(tensors[0].tolist())
        for w in works[1:]:
            w.wait()  # the payload, or a placeholder when the prediction was wrong
        self._known[self._key(a)] = (dtype, tuple(shape))
        if predicted == (dtype, tuple(shape)):
            return tensors[1]
        payload = torch.empty(shape, dtype=dtype, device=self.device)
        self._start([self._op(a, payload)])[0].wait()
        return payload

    def send(self, a: Action, tensor: torch.Tensor) -> None:
        """Hand `tensor` to the rank running the stage `a` sends to (asynchronous until flush())."""
        self._expect(a)
        self._staged[a] = tensor.detach().contiguous()
        self._issue_after(self._next)
        self._next += 1

    def recv(self, a: Action) -> torch.Tensor:
        """The tensor of receive `a`, from the rank running the stage it comes from."""
        self._expect(a)
        if self.policy == GROUPED:
            work, payload = self._posted.pop(a)
            work.wait()
        else:
            payload = self._finish_eager(a)
        self._issue_after(self._next)
        self._next += 1
        return payload

    def flush(self) -> None:
        """Wait until every send of this step has been handed over."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

