"""The runtime, directly: every rank of a pipeline in this process, no torch.distributed.

Each rank's `StageRunner` (over the stages the plan places on it) runs in its own thread over
`QueueTransport`, a `Transport` written here: one FIFO queue per directed stage link, a receive
that gives up after a few seconds (so a broken plan fails instead of hanging), and a log of
every call so the test can check that the runtime issued exactly the plan's transfers, in order.
"""

from __future__ import annotations

import copy
import queue
import threading

import pytest
import torch
from torch import nn

from brigade.errors import BrigadeError, RunError
from brigade.pipeline.batches import microbatch
from brigade.pipeline.plans.action import COMM_OPS, Action
from brigade.pipeline.plans.schedule import SCHEDULES, build, forward_only, stage_ranks
from brigade.pipeline.plans.validate import validate
from brigade.pipeline.runtime.interpreter import StageRunner, StepResult
from brigade.pipeline.transport.ordering import peer_of

BATCH = 7  # with m = 3: micro-batches of 3, 2, 2 (an uneven split, so the weights matter)
WIDTH = 4
TOL = dict(atol=1e-6, rtol=0.0)
LOSS_TOL = dict(atol=1e-6, rtol=0.0, check_dtype=False)  # the dtype has its own test below


class Aborted(Exception):
    """A stage stopped waiting because another stage failed."""


class QueueTransport:
    """A rank's end of in-memory links (implements `brigade.pipeline.transport.local.Transport`)."""

    peers = None  # all stages live in this process

    def __init__(self, hub: dict, rank: int, abort: threading.Event, timeout_s: float):
        self.hub, self.rank, self.abort, self.timeout_s = hub, rank, abort, timeout_s
        self.calls: list[Action] = []  # every send and receive, in the order issued
        self.begun: list[Action] | None = None
        self.flushes = 0

    def begin_step(self, actions: list[Action], inputs: list[torch.Tensor] | None = None) -> None:
        self.begun = list(actions)  # a queue needs nothing posted ahead, whatever the inputs

    def send(self, a: Action, tensor: torch.Tensor) -> None:
        self.calls.append(a)
        self.hub[(a.stage, peer_of(a))].put(tensor.detach().clone())  # no storage shared across ranks

    def recv(self, a: Action) -> torch.Tensor:
        self.calls.append(a)
        src = peer_of(a)
        waited = 0.0
        while waited < self.timeout_s:
            if self.abort.is_set():
                raise Aborted(f"stage {a.stage}: another stage failed")
            try:
                return self.hub[(src, a.stage)].get(timeout=0.02)
            except queue.Empty:
                waited += 0.02
        raise RunError(f"stage {a.stage}: nothing from stage {src} in {self.timeout_s:g}s")

    def flush(self) -> None:
        self.flushes += 1


def run_stages(plan: dict[int, list[Action]], stages: list[nn.Module], xs, ys=None, ws=None,
               keep_outputs=False, trace=False, timeout_s: float = 3.0):
    """Run every rank's actions, one thread per rank; returns (results per rank, transports, hub).

    Stage s runs on the rank the plan places it on. Raises the first rank's own error (not the
    Aborted of the neighbours it left waiting).
    """
    n, where = len(stages), stage_ranks(plan)
    hub = {(a, b): queue.Queue() for a in range(n) for b in range(n) if abs(a - b) == 1}
    abort = threading.Event()
    ranks = sorted(plan)
    first, last = where[0], where[n - 1]
    transports = [QueueTransport(hub, r, abort, timeout_s) for r in ranks]
    runners = [StageRunner({s: m for s, m in enumerate(stages) if where[s] == r}, n, transports[r],
                           nn.functional.mse_loss) for r in ranks]
    results: list[StepResult | None] = [None] * len(ranks)
    errors: list[BaseException | None] = [None] * len(ranks)

    def job(r: int) -> None:
        try:
            results[r] = runners[r].run(plan[r], xs if r == first else None, ys if r == last else None,
                                        ws if r == last else None, keep_outputs=keep_outputs and r == last,
                                        trace=trace)
        except BaseException as exc:  # noqa: BLE001 -- handed to the test thread below
            errors[r] = exc
            abort.set()

    threads = [threading.Thread(target=job, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 4)
    assert not any(t.is_alive() for t in threads), "a stage hung: the runtime never returned"
    root = [e for e in errors if e is not None and not isinstance(e, Aborted)]
    if root or any(errors):
        raise (root or [e for e in errors if e])[0]
    return results, transports, hub


def make_blocks(n_blocks: int) -> list[nn.Module]:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(n_blocks)]
    return [b.double() for b in blocks]


def data(batch: int = BATCH):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.randn(batch, WIDTH, generator=g, dtype=torch.float64)


def split_stages(blocks: list[nn.Module], n_stages: int) -> list[nn.Sequential]:
    """Stage s gets blocks s·k … s·k + k - 1 (the blocks are shared, not copied)."""
    k = len(blocks) // n_stages
    return [nn.Sequential(*blocks[s * k:(s + 1) * k]) for s in range(n_stages)]


def pipeline_step(schedule: str, n_ranks: int, m: int, plan=None, ws=None, virtual: int = 1):
    """One training step through the runtime and the same step on one device.

    Returns (results per rank, transports, pipeline blocks, reference blocks, reference loss).
    """
    n_stages = n_ranks * virtual
    blocks = make_blocks(2 * n_stages)
    reference = copy.deepcopy(blocks)
    x, y = data()
    ws = microbatch.weights(BATCH, m) if ws is None else ws
    plan = validate(build(schedule, n_ranks, m, virtual)) if plan is None else plan
    results, transports, _ = run_stages(plan, split_stages(blocks, n_stages), microbatch.split(x, m),
                                        microbatch.split(y, m), ws)
    out = nn.Sequential(*reference)(x)
    ref_loss = sum(w * nn.functional.mse_loss(o, t) for w, o, t in
                   zip(ws, microbatch.split(out, m), microbatch.split(y, m)))
    ref_loss.backward()
    return results, transports, blocks, reference, ref_loss


def assert_same_grads(blocks: list[nn.Module], reference: list[nn.Module]) -> None:
    got = dict(nn.Sequential(*blocks).named_parameters())
    want = dict(nn.Sequential(*reference).named_parameters())
    assert got.keys() == want.keys()
    for name, p in got.items():
        assert p.grad is not None, f"{name}: no gradient"
        torch.testing.assert_close(p.grad, want[name].grad, **TOL, msg=f"{name}")


def comm_calls(actions: list[Action]) -> list[Action]:
    """The transport calls the plan's transfers imply, in order."""
    return [a for a in actions if a.op in COMM_OPS]


def _virtuals(schedule: str) -> tuple[int, ...]:
    fixed = SCHEDULES[schedule].virtual
    return (fixed,) if fixed else (1, 2)


GRID = [(s, m, p, v) for s in SCHEDULES for m in (1, 3) for p in (2, 3) for v in _virtuals(s)]


@pytest.mark.parametrize("schedule,m,n_ranks,virtual", GRID)
def test_training_step_matches_one_device(schedule, m, n_ranks, virtual):
    plan = validate(build(schedule, n_ranks, m, virtual))
    results, transports, blocks, reference, ref_loss = pipeline_step(schedule, n_ranks, m, plan,
                                                                     virtual=virtual)
    last = stage_ranks(plan)[n_ranks * virtual - 1]
    torch.testing.assert_close(results[last].loss, ref_loss.detach(), **LOSS_TOL)
    assert all(r.loss is None for k, r in enumerate(results) if k != last)  # on the last stage's rank
    assert_same_grads(blocks, reference)
    for r, t in enumerate(transports):
        assert t.begun == plan[r]
        assert t.calls == comm_calls(plan[r]), f"rank {r} did not issue its plan's transfers"
        assert t.flushes == 1


def test_the_weights_scale_each_microbatch_loss():
    """loss = Σ weight_i · mean loss_i, and the gradients are those of that sum."""
    ws = [0.5, 0.0, 2.0]
    results, _, blocks, reference, ref_loss = pipeline_step("1f1b", 2, 3, ws=ws)
    torch.testing.assert_close(results[-1].loss, ref_loss.detach(), **LOSS_TOL)
    assert_same_grads(blocks, reference)


def test_share_weights_give_the_whole_batch_mean():
    """With `microbatch.weights`, the step's loss and gradients are the full batch's mean loss."""
    results, _, blocks, _, _ = pipeline_step("gpipe", 2, 3)
    reference = make_blocks(4)
    x, y = data()
    full = nn.functional.mse_loss(nn.Sequential(*reference)(x), y)
    full.backward()
    torch.testing.assert_close(results[-1].loss, full.detach(), **LOSS_TOL)
    assert_same_grads(blocks, reference)


@pytest.mark.parametrize("n_stages,m", [(2, 1), (3, 3)])
def test_forward_only_returns_the_merged_outputs(n_stages, m):
    blocks = make_blocks(2 * n_stages)
    x, y = data()
    plan = validate(forward_only(n_stages, m))
    results, _, _ = run_stages(plan, split_stages(blocks, n_stages), microbatch.split(x, m),
                               keep_outputs=True)
    with torch.no_grad():
        want = nn.Sequential(*blocks)(x)
    torch.testing.assert_close(microbatch.merge(results[-1].outputs), want, **TOL)
    assert results[-1].loss is None  # no targets: pure inference
    assert all(r.outputs == [] for r in results[:-1])
    assert all(p.grad is None for p in nn.Sequential(*blocks).parameters())


def test_forward_only_with_targets_gives_the_loss_without_gradients():
    blocks = make_blocks(4)
    x, y = data()
    plan = validate(forward_only(2, 3))
    results, _, _ = run_stages(plan, split_stages(blocks, 2), microbatch.split(x, 3),
                               microbatch.split(y, 3), microbatch.weights(BATCH, 3))
    with torch.no_grad():
        want = nn.functional.mse_loss(nn.Sequential(*blocks)(x), y)
    torch.testing.assert_close(results[-1].loss, want, **LOSS_TOL)
    assert not results[-1].loss.requires_grad
    assert all(p.grad is None for p in nn.Sequential(*blocks).parameters())


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_trace_has_one_entry_per_action(schedule):
    x, y = data()
    plan = validate(build(schedule, 2, 3))
    n = len(stage_ranks(plan))  # 2, or 4 with the schedule's own V of 2
    results, _, _ = run_stages(plan, split_stages(make_blocks(n), n), microbatch.split(x, 3),
                               microbatch.split(y, 3), microbatch.weights(BATCH, 3), trace=True)
    for s, r in enumerate(results):
        assert [a for a, _, _ in r.trace] == plan[s]
        starts = [start for _, start, _ in r.trace]
        assert starts == sorted(starts)
        assert all(start <= end for _, start, end in r.trace)
    untraced, _, _ = run_stages(plan, split_stages(make_blocks(n), n), microbatch.split(x, 3),
                                microbatch.split(y, 3), microbatch.weights(BATCH, 3))
    assert all(r.trace == [] for r in untraced)


def test_a_float64_loss_stays_float64():
    """The loss is upcast for half-precision outputs, never downcast (a float64 model stays float64)."""
    results, _, _, _, ref_loss = pipeline_step("gpipe", 2, 1)
    assert results[-1].loss.dtype == ref_loss.dtype == torch.float64


# A broken plan or a broken runtime must be seen: these are the mutants the checks above catch.

def test_swapped_forwards_give_wrong_gradients():
    """Stage 0 runs micro-batch 2 before 1, stage 1 does not: the comparison above must fail.

    (Micro-batches 1 and 2 have the same size, so nothing but the values can tell.)
    """
    plan = validate(build("gpipe", 2, 3))
    plan[0] = [*plan[0][:2], *plan[0][4:6], *plan[0][2:4], *plan[0][6:]]
    assert [str(a) for a in plan[0][2:6]] == ["0F2", "0SEND_F2", "0F1", "0SEND_F1"]
    results, _, blocks, reference, ref_loss = pipeline_step("gpipe", 2, 3, plan)
    with pytest.raises(AssertionError):
        assert_same_grads(blocks, reference)


def test_a_dropped_send_fails_instead_of_hanging():
    plan = validate(build("1f1b", 2, 3))
    plan[0] = [a for a in plan[0] if str(a) != "0SEND_F2"]
    with pytest.raises(RunError, match="nothing from stage"):  # both stages end up waiting
        pipeline_step("1f1b", 2, 3, plan)


def test_a_runtime_that_skips_a_send_is_caught(monkeypatch):
    """A gradient that never leaves stage 1 (not sent, not logged): stage 0 fails, it does not hang."""
    plan = validate(build("1f1b", 2, 1))
    sent = QueueTransport.send

    def lossy(self, a, tensor):
        if a.stage == 1:  # the gradient never leaves stage 1
            return
        sent(self, a, tensor)

    monkeypatch.setattr(QueueTransport, "send", lossy)
    with pytest.raises(RunError, match="nothing from stage 1"):
        pipeline_step("1f1b", 2, 1, plan)


def backward_first(n_stages: int) -> dict[int, list[Action]]:
    """A gpipe plan whose last stage runs B0 before F0."""
    plan = validate(build("gpipe", n_stages, 1))
    last = n_stages - 1
    plan[last] = [a for a in plan[last] if a.op != "F"]
    plan[last].insert(plan[last].index(Action(last, "B", 0)) + 1, Action(last, "F", 0))
    return plan


@pytest.mark.parametrize("n_stages", [1, 2])
def test_backward_before_forward_fails_instead_of_hanging(n_stages):
    with pytest.raises(Exception):  # noqa: B017 -- any error; the point is that it does not hang
        pipeline_step("gpipe", n_stages, 1, backward_first(n_stages))


def test_backward_before_forward_names_the_action():
    with pytest.raises(BrigadeError, match="1B0: no forward output for micro-batch 0 on stage 1"):
        pipeline_step("gpipe", 2, 1, backward_first(2))
