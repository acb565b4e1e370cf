"""The NCCL proof: issued groups run as NCCL runs them, deadlocks and mispairings named."""

import pytest
import torch

from brigade.pipeline.plans.action import Action, PlanError
from brigade.pipeline.plans.schedule import SCHEDULES, build, forward_only, stage_ranks
from brigade.pipeline.plans.validate import validate
from brigade.pipeline.transport import nccl, ordering


@pytest.mark.parametrize("mode", ordering.MODES)
@pytest.mark.parametrize("name", [*SCHEDULES, "forward"])
def test_grouped_policy_never_deadlocks_under_nccl(name, mode):
    for v in SCHEDULES[name].virtuals(3) if name in SCHEDULES else (1,):
        for p in range(1, 6):
            for m in range(1, 10):
                plan = validate(forward_only(p, m) if name == "forward" else build(name, p, m, v))
                nccl.check(plan, ordering.GROUPED, mode)


def test_discovery_sends_headers_then_payloads_round_by_round():
    streams = nccl.issued(validate(build("1f1b", 2, 2)), ordering.GROUPED, ordering.DISCOVERY)
    names = [" ".join(map(nccl._name, g)) for g in streams[0]]
    assert names == ["0SEND_F0'", "0SEND_F0", "0SEND_F1'", "0SEND_F1", "0RECV_B0'", "0RECV_B0",
                     "0RECV_B1'", "0RECV_B1"]


def _headers_then_payloads_per_batch(plan):
    """The naive discovery layout: every header of a batch, then its payloads."""
    return {r: [g for i in ordering.posting(plan, r, ordering.GROUPED)
                for g in (tuple((a, nccl.HEADER) for a in i.ops),
                          tuple((a, nccl.PAYLOAD) for a in i.ops))]
            for r, acts in plan.items()}


def test_naive_discovery_deadlocks_where_a_receive_needs_the_batch_send():
    # GPipe, 1 micro-batch: 0RECV_B0's header needs 0SEND_F0's payload, in the next group.
    streams = _headers_then_payloads_per_batch(validate(build("gpipe", 2, 1)))
    with pytest.raises(PlanError, match=r"NCCL deadlock: rank 0 is stuck at \[0SEND_F0' 0RECV_B0'\]"):
        nccl.simulate_nccl(streams)


def test_discovery_batches_cut_by_round():
    plan = validate(build("gpipe", 2, 1))
    assert [i.ops for i in ordering.posting(plan, 0, ordering.GROUPED)] == [
        (Action(0, "SEND_F", 0), Action(0, "RECV_B", 0))]
    assert [i.ops for i in nccl.discovery_batches(plan, 0)] == [
        (Action(0, "SEND_F", 0),), (Action(0, "RECV_B", 0),)]


def test_ranks_in_different_modes_mispair():
    plan = validate(build("1f1b", 2, 2))
    predicted = nccl.issued(plan, ordering.GROUPED)
    discovery = nccl.issued(plan, ordering.GROUPED, ordering.DISCOVERY)
    with pytest.raises(PlanError, match="should meet"):
        nccl.simulate_nccl({0: predicted[0], 1: discovery[1]})


def test_a_payload_is_not_received_before_its_header():
    # The host sizes a receive from its header: both in one group can never be issued.
    f = (Action(0, "SEND_F", 0), Action(1, "RECV_F", 0))
    streams = {0: [((f[0], nccl.HEADER), (f[0], nccl.PAYLOAD))],
               1: [((f[1], nccl.HEADER), (f[1], nccl.PAYLOAD))]}
    stuck = "rank 1 cannot issue \\[1RECV_F0' 1RECV_F0\\] before 1RECV_F0' completes"
    with pytest.raises(PlanError, match=stuck):
        nccl.simulate_nccl(streams)


def test_unknown_mode_is_refused():
    with pytest.raises(PlanError, match="^mode 'guess': expected one of predicted, discovery$"):
        nccl.issued(validate(build("1f1b", 2, 2)), ordering.GROUPED, "guess")


def test_old_eager_policy_deadlocks_1f1b_on_two_stages():
    with pytest.raises(PlanError, match=r"NCCL deadlock: rank 0 is stuck at \[0RECV_B0\]"):
        nccl.check(validate(build("1f1b", 2, 4)), ordering.EAGER)


def test_grouped_keeps_two_ranks_that_send_to_each_other_apart():
    """Interleaved: ranks 0 and 1 both send on two links each way; the old policy (a send, then
    the receives up to the next send) deadlocked here under NCCL. The clock order does not."""
    plan = validate(build("interleaved", 2, 4, 2))
    for mode in ordering.MODES:
        nccl.check(plan, ordering.GROUPED, mode)
    old = {r: [g for g in _old_grouped(plan[r])] for r in plan}
    with pytest.raises(PlanError, match="NCCL deadlock"):
        nccl.simulate_nccl(old, stage_ranks(plan))


def _old_grouped(actions):
    """The posting of the previous round: each send opens a batch that takes the receives after it."""
    groups, ops = [], []
    for a in (a for a in actions if "SEND" in a.op or "RECV" in a.op):
        if "SEND" in a.op and ops:
            groups.append(tuple((b, nccl.PAYLOAD) for b in ops))
            ops = []
        ops.append(a)
    return groups + ([tuple((b, nccl.PAYLOAD) for b in ops)] if ops else [])


def test_mispaired_streams_are_reported():
    streams = {0: [((Action(0, "SEND_F", 0), 0),)], 1: [((Action(1, "RECV_F", 1), 0),)]}
    with pytest.raises(PlanError, match="^0SEND_F0 should meet 1RECV_F0 on rank 1 but its #0 receive there "
                                        "is 1RECV_F1$"):
        nccl.simulate_nccl(streams)


def test_a_send_that_no_receive_meets_is_reported():
    streams = {0: [((Action(0, "SEND_F", 0), nccl.PAYLOAD),)], 1: []}
    with pytest.raises(PlanError, match="^0SEND_F0 should meet 1RECV_F0 on rank 1 but no receive is issued "
                                        "there$"):
        nccl.simulate_nccl(streams)


def test_a_receive_that_no_send_meets_is_reported():
    # Rank 0 sends micro-batch 0 only; rank 1 waits for 0 and 1.
    streams = {0: [((Action(0, "SEND_F", 0), nccl.PAYLOAD),)],
               1: [((Action(1, "RECV_F", 0), nccl.PAYLOAD),), ((Action(1, "RECV_F", 1), nccl.PAYLOAD),)]}
    with pytest.raises(PlanError, match="^1RECV_F1 is never matched by rank 0$"):
        nccl.simulate_nccl(streams)


def test_a_deadlock_names_each_stuck_rank_and_not_one_that_finished():
    """Rank 0 hands its activation over and is done; rank 1 waits for a gradient before it
    sends the activation that stage 2 waits for."""
    rows = ["0SEND_F0", "1RECV_F0 1RECV_B0 1SEND_F0", "2RECV_F0 2SEND_B0"]  # one group per op
    streams = {r: [((Action.parse(t), nccl.PAYLOAD),) for t in row.split()] for r, row in enumerate(rows)}
    stuck = (r"^NCCL deadlock: rank 1 is stuck at \[1RECV_B0\]: 1RECV_B0 waits for 2SEND_B0, queued behind "
             r"\[2RECV_F0\] on rank 2; rank 2 is stuck at \[2RECV_F0\]: 2RECV_F0 waits for 1SEND_F0, "
             r"queued behind \[1RECV_B0\] on rank 1$")
    with pytest.raises(PlanError, match=stuck):
        nccl.simulate_nccl(streams)


def test_rounds_count_the_steps_of_the_predicted_run_from_zero():
    # GPipe, 1 micro-batch: the activation in round 0, its gradient in round 1.
    rounds = nccl.rounds(validate(build("gpipe", 2, 1)), ordering.GROUPED)
    assert {str(a): k for a, k in rounds.items()} == {"0SEND_F0": 0, "1RECV_F0": 0, "1SEND_B0": 1,
                                                     "0RECV_B0": 1}


def _grid():
    """Every schedule with V = 1 and 2 where it allows them, p in 1..4, m in 1..6."""
    for name, sched in SCHEDULES.items():
        for v in (sched.virtual,) if sched.virtual else (1, 2):
            for p in range(1, 5):
                for m in range(1, 7):
                    yield f"{name} V={v} p={p} m={m}", validate(build(name, p, m, v))


def test_discovery_with_structures_never_deadlocks_under_nccl():
    for label, plan in _grid():
        try:
            nccl.check(plan, ordering.GROUPED, ordering.DISCOVERY, structures=True)
        except PlanError as exc:
            raise AssertionError(f"{label}: {exc}") from exc


def _sends(plan, keep):
    return {a for acts in plan.values() for a in acts if a.op in ("SEND_F", "SEND_B") and keep(a)}


@pytest.mark.parametrize("keep", [lambda a: a.op == "SEND_F", lambda a: a.microbatch % 2,
                                  lambda a: (a.stage + a.microbatch) % 3 == 0])
def test_discovery_with_some_structures_never_deadlocks_under_nccl(keep):
    """Only some messages are structures: parts with none of them have no description group."""
    for label, plan in _grid():
        try:
            nccl.check(plan, ordering.GROUPED, ordering.DISCOVERY, structures=_sends(plan, keep))
        except PlanError as exc:
            raise AssertionError(f"{label}: {exc}") from exc


def test_discovery_sends_headers_descriptions_then_payloads():
    plan = validate(build("gpipe", 3, 4))
    streams = nccl.issued(plan, ordering.GROUPED, ordering.DISCOVERY, structures=True)
    names = [" ".join(map(nccl._name, g)) for g in streams[1]]
    assert names[6:9] == ["1SEND_F0' 1RECV_F2'", '1SEND_F0" 1RECV_F2"', "1SEND_F0 1RECV_F2"]
    # Only the forward messages are structures: the backward parts have no description group.
    some = nccl.issued(plan, ordering.GROUPED, ordering.DISCOVERY, _sends(plan, lambda a: a.op == "SEND_F"))
    names = [" ".join(map(nccl._name, g)) for g in some[1]]
    assert names[-4:] == ["1SEND_B2' 1RECV_B3'", "1SEND_B2 1RECV_B3", "1SEND_B3'", "1SEND_B3"]
    assert names[6:9] == ["1SEND_F0' 1RECV_F2'", '1SEND_F0" 1RECV_F2"', "1SEND_F0 1RECV_F2"]
    assert nccl.issued(plan, ordering.GROUPED, ordering.DISCOVERY) == \
        nccl.issued(plan, ordering.GROUPED, ordering.DISCOVERY, structures=set())


def _merged(streams, into):
    """A mutant: each description group merged into its part's header (-1) or payload (+1) group."""
    out = {}
    for r, groups in streams.items():
        groups, kept = list(groups), []
        for k, g in enumerate(groups):
            if g[0][1] == nccl.DESCRIPTION:
                groups[k + into] = groups[k + into] + g if into > 0 else groups[k + into]
                if into < 0:
                    kept[-1] = kept[-1] + g
            else:
                kept.append(groups[k])
        out[r] = kept
    return out


@pytest.mark.parametrize("into, stuck", [(-1, "before (.*)' completes"), (1, 'before (.*)" completes')])
def test_a_description_shares_no_group_with_its_header_or_payload(into, stuck):
    """Mutants: a receive's description issued with its header (the host cannot know its
    length yet), or its payload with its description (nor its size): caught as deadlocks."""
    caught = 0
    for label, plan in _grid():
        streams = nccl.issued(plan, ordering.GROUPED, ordering.DISCOVERY, structures=True)
        mutant = _merged(streams, into)
        if len(plan) == 1:
            assert mutant == streams == {0: []}, label  # one stage: nothing to send
            continue
        with pytest.raises(PlanError, match=f"NCCL deadlock: .*cannot issue .*{stuck}"):
            nccl.simulate_nccl(mutant, stage_ranks(plan))
        caught += 1
    assert caught == sum(len(p) > 1 for _, p in _grid())


COMBOS = [(name, v) for name, s in SCHEDULES.items() for v in ((s.virtual,) if s.virtual else (1, 2))]
WORLD, M = 3, 3


def _structured(a) -> bool:
    """Step 2's messages: forward ones structures from micro-batch 1 on, the rest plain."""
    return a.op == "SEND_F" and a.microbatch > 0


def _payload(step: int, a):
    """What send `a` carries: steps 0 and 1 structures (two tensors and an int), step 2 mixed."""
    t = torch.full((2 + step // 2, 3), float(10 * a.stage + a.microbatch))
    if step < 2 or _structured(a):
        return {"h": t, "ids": torch.arange(2 + step // 2), "mb": a.microbatch}
    return t


def _record_issues(rank: int, world: int, port: int, out) -> None:
    """Run each schedule's comms for 3 steps (discovery, predicted, discovery) through
    P2PTransport on gloo under the grouped policy, logging every batch it issues as
    (comm action, part) per message: a part is the number of `_exchange` calls so far in
    `_issue_discovery` (meta headers, then descriptions), payload outside them."""
    import itertools

    import torch.distributed as dist

    from brigade.pipeline.transport.p2p import P2PTransport

    class Recording(P2PTransport):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.log, self.pending, self.part, self.exchanges = [], [], nccl.PAYLOAD, 0

        def _issue_discovery(self, batch):
            self.exchanges = 0
            super()._issue_discovery(batch)

        def _exchange(self, sends, recvs):
            self.part, self.exchanges = (nccl.HEADER, nccl.DESCRIPTION)[self.exchanges], self.exchanges + 1
            try:
                return super()._exchange(sends, recvs)
            finally:
                self.part = nccl.PAYLOAD

        def _op(self, a, t):
            self.pending.append((a, self.part))
            return super()._op(a, t)

        def _start(self, ops):
            if ops:  # one op per tensor: a message's tensors, consecutive, log as one
                self.log.append(tuple(k for k, _ in itertools.groupby(self.pending)))
            self.pending.clear()
            return super()._start(ops)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    logs, wrong = {}, []
    for name, v in COMBOS:
        plan = validate(build(name, world, M, v))
        ranks = stage_ranks(plan)
        t = Recording([ranks[s] for s in range(len(ranks))], torch.device("cpu"), policy="grouped",
                      plans=[plan])
        for step in range(3):
            t.log.clear()
            t.begin_step(plan[rank], [torch.zeros(2 + step // 2, 3)] * M if ranks[0] == rank else None)
            for a in plan[rank]:
                if a.op.startswith("SEND"):
                    t.send(a, _payload(step, a))
                elif a.op.startswith("RECV"):
                    got = t.recv(a)
                    sent = nccl._send_of(a)
                    if type(got) is not type(_payload(step, sent)):
                        wrong.append(f"{name} V={v} step {step} {a}: {type(got).__name__}")
            t.flush()
            logs[(name, v, step)] = (t.mode, list(t.log))
    out.put((rank, logs, wrong))
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_p2p_issues_exactly_the_groups_the_proof_runs():
    """P2P's batches, recorded on 3 gloo processes under the grouped policy, are the groups
    `nccl.issued` lays out (same groups, same order): every schedule, discovery with
    structures, predicted, discovery with some structures and some plain tensors."""
    from tests.pipeline.transport.test_p2p import _spawn

    results = _spawn(_record_issues, WORLD)
    for name, v in COMBOS:
        plan = validate(build(name, WORLD, M, v))
        some = {a for acts in plan.values() for a in acts if a.op == "SEND_F" and _structured(a)}
        model = [nccl.issued(plan, ordering.GROUPED, ordering.DISCOVERY, True),
                 nccl.issued(plan, ordering.GROUPED, ordering.PREDICTED),
                 nccl.issued(plan, ordering.GROUPED, ordering.DISCOVERY, some)]
        for rank, (logs, wrong) in results.items():
            assert wrong == [], f"rank {rank}: {wrong}"
            for step, mode in enumerate(["discovery", "predicted", "discovery"]):
                where = f"{name} V={v} step {step} rank {rank}"
                assert logs[(name, v, step)] == (mode, model[step][rank]), where


def test_discovery_batches_keep_the_place_of_the_grouped_batch_they_cut():
    plan = validate(build("1f1b", 2, 3))
    got = [(i.after, [str(a) for a in i.ops]) for i in nccl.discovery_batches(plan, 0)]
    assert got == [(0, ["0SEND_F0"]), (1, ["0SEND_F1"]), (1, ["0RECV_B0"]), (3, ["0SEND_F2"]),
                   (3, ["0RECV_B1"]), (3, ["0RECV_B2"])]
