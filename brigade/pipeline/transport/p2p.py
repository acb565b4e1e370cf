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
               [meta headers] ─host reads─► [descriptions, structures only]
               ─host reads─► [payloads]. The layouts seen become the next
               step's predictions.

A message is a tensor or a structure (`structure.flatten`): its tensors travel in one
batch, in flatten order, as that comm action's message, so NCCL pairs them as it pairs a
single tensor. What describes it (`message`: structure, dtypes, shapes) travels only when
the receiver cannot know it: in discovery, a fixed-size meta header, then for a structure
its description (one more exchange, issued once the meta headers are read, as the payloads
are once the descriptions are), then the payloads; in predicted mode never (the previous
step's). `nccl.check(plan, "grouped", "discovery", structures=...)` proves these three
exchanges deadlock-free, and tests/pipeline/transport/test_nccl.py records the batches P2P issues and
compares them with the proof's groups.

Assumption: every message's structure, dtypes and shapes are a function of the plan and
of the micro-batches' input structures, dtypes and shapes (side inputs included). A
model whose shapes depend on values must pass shapes="dynamic" (discovery every step);
a send that differs from its prediction in predicted mode is refused with that advice.

eager (gloo): each receive is posted as soon as the previous one from that
neighbour arrived, as a meta header and tensors of the predicted layout; when the
prediction is missing or wrong the sender follows the meta header with placeholders
of the predicted layout, then (a structure's description and) the payload in a
batch of its own:

    sender   [meta (placeholders)] [description, payload]
    receiver [meta (predicted)]  read meta ─► as predicted? done : [recv description] [payload]

Gloo buffers a send whose receive is not posted yet, so this never deadlocks
there; under NCCL it would (`nccl.check(plan, "eager")`), so it is refused.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from brigade.errors import RunError
from brigade.pipeline.plans.action import COMM_OPS, RECV_F, SEND_B, SEND_F, Action, Plan
from brigade.pipeline.transport import message
from brigade.pipeline.transport.message import META_LEN, MessageLayout
from brigade.pipeline.transport.nccl import discovery_batches
from brigade.pipeline.transport.ordering import (
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
        self._flag_work: dist.Work | None = None  # the first stage's broadcast of this step's mode
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        self._known: dict[tuple[int, int, str, int], MessageLayout] = {}  # (stage, peer, F|B, mb) -> layout
        self._headers: dict[tuple, torch.Tensor] = {}  # meta header or description, on device
        self._staged: dict[Action, tuple] = {}  # send -> (tensors, layout) until its batch is issued
        self._posted: dict[Action, tuple] = {}  # recv -> policy-specific receive state
        self._comms: list[Action] = []
        self._issues: dict[int, list[tuple[Action, ...]]] = {}
        self._next = 0

    def also_run(self, plan: Plan) -> None:
        """Know `plan` (all ranks, with comms) too: a pipeline planned again (`Pipeline.replan`)."""
        self.plans.append(plan)

    def begin_step(self, actions: list[Action], inputs: object = None) -> None:
        """Take this rank's actions (with comms) for the step; issue what comes first.

        Args:
            actions: this rank's actions. inputs: the micro-batches, tensors or structures
                (first stage only), and its side inputs if any.
        """
        self._comms = [a for a in actions if a.op in COMM_OPS]
        if self.policy == GROUPED:
            self.mode = self._agree_mode(actions, inputs)
        self._issues = {}
        for issue in self._batches(actions):
            self._issues.setdefault(issue.after, []).append(issue.ops)
        self._next = 0
        self._issue_after(BEGIN)

    def _agree_mode(self, actions: list[Action], inputs: object) -> str:
        if len(set(self.peers)) == 1:
            return PREDICTED  # nothing to send
        if self.first:
            key = (tuple(actions), message.key_of(inputs))  # structure, dtypes and shapes
            mode = mode_for(self._last_key, key, self.shapes)
            self._last_key = key
            self._wait_flag()  # the previous step's broadcast may still read the flag
            self._flag.fill_(int(mode == PREDICTED))  # no host sync: a kernel on the device
            # The root needs nothing back: on gloo a blocking broadcast would hold it until every
            # rank has joined (measured: its first action 8-25 ms late); flush() waits instead.
            self._flag_work = dist.broadcast(self._flag, self.peers[0], group=self.group, async_op=True)
            return mode
        dist.broadcast(self._flag, self.peers[0], group=self.group)
        return PREDICTED if self._flag.item() else DISCOVERY  # the step's one host sync

    def _wait_flag(self) -> None:
        if self._flag_work is not None:
            self._flag_work.wait()
            self._flag_work = None

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

    def _header(self, layout: MessageLayout, part: str = "meta", same: bool = False) -> torch.Tensor:
        """The meta header or description of `layout`, on the device (copied once per layout)."""
        key = (layout, part, same)
        if key not in self._headers:
            code = message.meta(layout, same) if part == "meta" else message.describe(layout)
            self._headers[key] = torch.tensor(code, dtype=torch.int64, device=self.device)
        return self._headers[key]

    def _issue_after(self, k: int) -> None:
        for batch in self._issues.pop(k, []):
            if self.policy != GROUPED:
                self._issue_eager(batch)
            elif self.mode == PREDICTED:
                self._issue_predicted(batch)
            else:
                self._issue_discovery(batch)

    def _issue_predicted(self, batch: tuple[Action, ...]) -> None:
        ops, recvs = [], []
        for a in batch:
            predicted = self._known.get(self._key(a))
            if a.op in (SEND_F, SEND_B):
                tensors, layout = self._staged.pop(a)
                if layout != predicted:
                    raise RunError(f"rank {self.rank}: {a} is {message.show(layout)} but was "
                                   f"{message.show(predicted)} in the previous step with the same input "
                                   "shapes: shapes depend on values here; use shapes='dynamic'")
            elif predicted is None:
                raise RunError(f"rank {self.rank}: no shape known for {a} in a predicted step")
            else:
                tensors = message.buffers(predicted, self.device)
                recvs.append((a, len(ops), tensors, predicted))
            ops += [self._op(a, t) for t in tensors]  # one message: its tensors in one batch
        works = self._start(ops)
        for a, k, tensors, layout in recvs:
            self._posted[a] = (works[k:k + len(tensors)], tensors, layout)

    def _issue_discovery(self, batch: tuple[Action, ...]) -> None:
        """[meta headers] ─read─► [descriptions of structures] ─read─► [payloads]."""
        sends = [(a, *self._staged.pop(a)) for a in batch if a.op in (SEND_F, SEND_B)]
        recvs = [a for a in batch if a.op not in (SEND_F, SEND_B)]
        metas = [torch.empty(META_LEN, dtype=torch.int64, device=self.device) for _ in recvs]
        read = self._exchange([(a, self._header(lay)) for a, _, lay in sends], list(zip(recvs, metas)))
        read = [message.read_meta(m) for m in read]
        # Structures only: their descriptions, sized by the meta headers just read.
        descs = [None if isinstance(r, tuple) else torch.empty(r, dtype=torch.int64, device=self.device)
                 for r in read]
        out = [(a, self._header(lay, "desc")) for a, _, lay in sends if not message.plain(lay)]
        got = self._exchange(out, [(a, d) for a, d in zip(recvs, descs) if d is not None])
        got.reverse()
        layouts = [r if d is None else message.read_description(got.pop()) for r, d in zip(read, descs)]
        bufs = [message.buffers(lay, self.device) for lay in layouts]
        ops = [self._op(a, t) for a, tensors, _ in sends for t in tensors]
        k = len(ops)
        ops += [self._op(a, t) for a, tensors in zip(recvs, bufs) for t in tensors]
        works = self._start(ops)
        for a, _, lay in sends:
            self._known[self._key(a)] = lay
        for a, tensors, lay in zip(recvs, bufs, layouts):
            self._known[self._key(a)] = lay
            self._posted[a] = (works[k:k + len(tensors)], tensors, lay)
            k += len(tensors)

    def _exchange(self, sends: list, recvs: list) -> list[list[int]]:
        """Issue int64 headers as one batch, wait for the received ones and read them on the
        host at once (the one host synchronisation of this exchange)."""
        if not sends and not recvs:
            return []
        works = self._start([self._op(a, t) for a, t in [*sends, *recvs]])
        for w in works[len(sends):]:
            w.wait()
        return [t.tolist() for t in (torch.cat([t for _, t in recvs]).cpu().split(
            [t.numel() for _, t in recvs]) if recvs else [])]

    def _issue_eager(self, batch: tuple[Action, ...]) -> None:
        for a in batch:
            if a.op not in (SEND_F, SEND_B):
                self._post_eager(a)
                continue
            tensors, layout = self._staged.pop(a)
            predicted = self._known.get(self._key(a))
            self._known[self._key(a)] = layout
            if predicted == layout:
                self._start([self._op(a, t) for t in (self._header(layout, same=True), *tensors)])
                continue
            placeholders = message.buffers(predicted, self.device, zeros=True) if predicted else []
            self._start([self._op(a, t) for t in (self._header(layout), *placeholders)])
            desc = [] if message.plain(layout) else [self._header(layout, "desc")]
            self._start([self._op(a, t) for t in (*desc, *tensors)])  # late: the receiver reads the meta

    def _post_eager(self, a: Action) -> None:
        predicted = self._known.get(self._key(a))
        tensors = [torch.empty(META_LEN, dtype=torch.int64, device=self.device)]
        tensors += message.buffers(predicted, self.device) if predicted else []
        works = self._start([self._op(a, t) for t in tensors])
        self._posted[a] = (works, tensors, predicted)

    def _finish_eager(self, a: Action) -> object:
        works, tensors, predicted = self._posted.pop(a)
        for w in works:
            w.wait()  # the meta header, then the payload or placeholders of the wrong size
        layout = message.read_meta(tensors[0].tolist())
        if layout is None:
            return message.build(tensors[1:], predicted)
        if isinstance(layout, int):
            desc = torch.empty(layout, dtype=torch.int64, device=self.device)
            self._start([self._op(a, desc)])[0].wait()
            layout = message.read_description(desc.tolist())
        self._known[self._key(a)] = layout
        payload = message.buffers(layout, self.device)
        for w in self._start([self._op(a, t) for t in payload]):
            w.wait()
        return message.build(payload, layout)

    def send(self, a: Action, obj: object) -> None:
        """Hand a tensor or structure to the rank running the stage `a` sends to (asynchronous
        until flush()). Raises StructureError for something that cannot be sent."""
        self._expect(a)
        self._staged[a] = message.layout_of(obj)
        self._issue_after(self._next)
        self._next += 1

    def recv(self, a: Action) -> object:
        """The tensor or structure of receive `a`, from the rank running the stage it comes from."""
        self._expect(a)
        if self.policy == GROUPED:
            works, tensors, layout = self._posted.pop(a)
            for w in works:
                w.wait()
            payload = message.build(tensors, layout)
        else:
            payload = self._finish_eager(a)
        self._issue_after(self._next)
        self._next += 1
        return payload

    def flush(self) -> None:
        """Wait until every send of this step (and the mode's broadcast) has been handed over."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        self._wait_flag()

