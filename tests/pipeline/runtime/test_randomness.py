"""Dropout in a LocalPipeline repeats bit for bit, however its device threads are timed.

On the CPU every "device" of a LocalPipeline is the CPU, and its threads share one generator:
the masks once came out of it in whichever order the threads reached their dropouts. Here a
`Delay` before each stage's dropout shifts that order on purpose (stage 0 late, then stage 1
late); what the step computes must not change. Each run builds the same stages afresh.
"""

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from brigade.pipeline.pipe import LocalPipeline
from brigade.pipeline.plans.schedule import names, placement

pytestmark = pytest.mark.timeout(120)
M = 4  # micro-batches: enough that stage 0's later forwards overlap stage 1's earlier ones


class Delay(nn.Module):
    """Sleeps `seconds` before passing its input on: moves when this stage reaches its dropout."""

    def __init__(self, seconds: float = 0.0):
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return x


class Watched(nn.Module):
    """Records, per forward, whether a dispatch mode (the runner's RNG watch) was active."""

    def __init__(self, seen: list):
        super().__init__()
        self.seen = seen

    def forward(self, x):
        self.seen.append(_get_current_dispatch_mode() is not None)
        return x


class WatchedDropout(nn.Dropout):
    """A dropout that records, per forward, whether it ran watched."""

    def __init__(self, p: float, seen: list):
        super().__init__(p)
        self.seen = seen

    def forward(self, x):
        self.seen.append(_get_current_dispatch_mode() is not None)
        return super().forward(x)


class Sometimes(nn.Module):
    """Draws a random number from its `after`-th forward on: a draw no first forward shows."""

    def __init__(self, after: int):
        super().__init__()
        self.after, self.calls = after, 0

    def forward(self, x):
        self.calls += 1
        return x + 0 * torch.rand(()) if self.calls > self.after else x


def stages(n: int, delays=(), p: float = 0.5, extra=None) -> list[nn.Module]:
    """n stages of Linear → Delay → Dropout(p), the same weights every time (seeded here)."""
    torch.manual_seed(0)
    out = []
    for s in range(n):
        layers = [nn.Linear(8, 8), Delay(delays[s] if s < len(delays) else 0.0), nn.Dropout(p)]
        out.append(nn.Sequential(*layers, *(extra(s) if extra else ())))
    return out


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def step(schedule: str = "1f1b", delays=(), p: float = 0.5, seed: int = 3, extra=None, steps: int = 1):
    """The losses and final gradients of `steps` steps of a fresh two-device CPU pipeline."""
    n = len(placement(schedule, 2)[1])
    mods = stages(n, delays, p, extra)
    torch.manual_seed(seed)  # the process's generator, as the Trainer seeds it per rank
    x, y = batch()
    losses = []
    with LocalPipeline(mods, ["cpu", "cpu"], schedule, M, F.mse_loss) as pipe:
        for _ in range(steps):
            for mod in mods:
                mod.zero_grad(set_to_none=True)
            losses.append(pipe.step(x, y))
    return losses, [q.grad for mod in mods for q in mod.parameters()]


def equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("schedule", names())
def test_dropout_masks_do_not_depend_on_thread_timing(schedule):
    late0 = step(schedule, delays=(0.01, 0.0))
    late1 = step(schedule, delays=(0.0, 0.01, 0.01))
    assert equal(late0[0], late1[0]), (late0[0], late1[0])
    assert equal(late0[1], late1[1])
    assert not equal(step(schedule, p=0.0)[0], late0[0])  # dropout did change the loss


def test_each_step_and_seed_draws_other_masks():
    losses, _ = step(steps=2)
    assert not torch.equal(losses[0], losses[1])  # same batch, same weights: only the masks differ
    assert not equal(step(seed=4)[0], step(seed=3)[0])


def test_masks_follow_stage_and_microbatch_not_the_schedule():
    """gpipe and 1f1b run each stage's forwards in other orders: the masks stay where they were."""
    gpipe, one = step("gpipe", delays=(0.01,)), step("1f1b", delays=(0.0, 0.01))
    assert torch.equal(gpipe[0][0], one[0][0])
    for a, b in zip(gpipe[1], one[1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_restored_generator_repeats_the_step():
    """What a resume does: the process generator as a snapshot saved it, then the next step."""
    x, y = batch()
    first, again = stages(2, (0.01,)), stages(2, (0.0, 0.01))  # (built with a seed of their own)
    torch.manual_seed(11)
    with LocalPipeline(first, ["cpu", "cpu"], "1f1b", M, F.mse_loss) as pipe:
        pipe.step(x, y)
        saved = torch.get_rng_state()
        second = pipe.step(x, y)
    torch.set_rng_state(saved)
    with LocalPipeline(again, ["cpu", "cpu"], "1f1b", M, F.mse_loss) as pipe:
        assert torch.equal(pipe.step(x, y), second)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_evaluation_leaves_the_process_generator_alone(mode):
    """A snapshot is taken before a step's evaluation, and a resumed run does not evaluate again:
    an evaluation that drew from the process generator would shift every later step's masks."""
    mods = stages(2)
    for mod in mods:
        mod.train(mode == "train")
    x, y = batch()
    with LocalPipeline(mods, ["cpu", "cpu"], "1f1b", M, F.mse_loss) as pipe:
        before = torch.get_rng_state()
        first = pipe.evaluate(x, y)
        pipe.forward(x)
        assert torch.equal(torch.get_rng_state(), before)
        assert torch.equal(pipe.evaluate(x, y), first) == (mode == "eval")


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_only_the_modules_that_draw_are_watched(p):
    """The watch costs a Python call per operation: after a stage's first forward, only the modules
    that drew from the shared generator in it run watched (none at dropout 0); the rest run bare."""
    seen = {0: [], 1: []}
    drops = {0: [], 1: []}
    step(p=0.0, steps=3, extra=lambda s: [Watched(seen[s]), WatchedDropout(p, drops[s])])
    for s in (0, 1):
        assert seen[s][0] and drops[s][0]  # the first forward, watched whole
        assert seen[s][1:] == [False] * (3 * M - 1)
        assert drops[s][1:] == [p > 0] * (3 * M - 1)


def test_a_draw_that_came_late_is_caught_and_watched_from_then_on():
    """Stage 1 draws from its second step on, unwatched (its first forward drew nothing): the
    step ends with a warning, and every forward of the steps after it is watched."""
    seen = {0: [], 1: []}

    def extra(s):
        return [Sometimes(after=M if s == 1 else 10**9), Watched(seen[s])]

    with pytest.warns(RuntimeWarning, match="drew random numbers outside"):
        step(p=0.0, steps=3, extra=extra)
    assert seen[0][M:2 * M] == [False] * M and seen[0][2 * M:] == [True] * M
