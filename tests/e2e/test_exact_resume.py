"""Exact resume is a property of every registered schedule: a run with a rank killed mid-run,
restarted from its snapshot, ends bit for bit where the run that never stopped ends.

The schedules come from the registry (`schedule.names()`), so one registered later is covered
by construction. Each runs under pp 2, dp 2 × pp 2, two local stages in one process and
dp 2 × two local stages, on a tied GPT with dropout: the V placements (zbv, dualpipev) put the
embedding's stage and the head's on one rank, the case a loader once got wrong (both copies of
the tie were handed one optimizer state, stepped twice). Local stages are threads of one
process that share its CPU generator, whose dropout masks once followed the threads' timing:
two runs that never stopped parted within a few steps (so they are also compared with each other).

Six steps, a snapshot every two, the kill as step 4 begins: step 3 is lost and run again, and
three steps follow the resume (a wrong optimizer state shows in the loss from the second on).
Each run is `brigade train` through the CLI's `main` in this process: no `brigade` process start
per run; the same agent, workers and restarts.
"""

import json
from pathlib import Path

import pytest

from brigade.pipeline.plans.registry import names
from tests.e2e.helpers import final_hash, losses

pytestmark = pytest.mark.timeout(180)
RUN = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--context", "16", "--block-size", "16",
       "--batch-size", "8", "--microbatches", "2", "--dropout", "0.1", "--seed", "21",
       "--max-steps", "6", "--snapshot-every", "2", "--eval-every", "100", "--eval-batches", "1",
       "--sample-tokens", "0", "--warmup-steps", "2"]
# layout flags, and the rank to kill: under dp 2 × pp 2 rank 2 is the second replica's first
# pipeline rank, which under a V holds both ends of the model; under dp 2 × local stages rank 1
# is the second replica (all its stages die with it).
LAYOUTS = {"pp2": (["--nproc", "2", "--pp", "2"], 1), "dp2xpp2": (["--nproc", "4", "--pp", "2"], 2),
           "local2": (["--nproc", "1", "--local-stages", "2"], 0),
           "dp2xlocal2": (["--nproc", "2", "--local-stages", "2"], 1)}
CASES = [pytest.param(layout, name, id=f"{layout}-{name}") for layout in LAYOUTS for name in names()]


def _train(out: Path, *flags: str) -> None:
    """`brigade train` as the user types it, run by the CLI's `main` in this process."""
    from brigade.cli import main

    assert main(["train", "--out", str(out), *RUN, *flags]) == 0


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run that never stopped, per (layout, schedule): trained once, on first use."""
    made: dict[tuple[str, str], Path] = {}

    def get(layout: str, schedule: str) -> Path:
        if (layout, schedule) not in made:
            out = tmp_path_factory.mktemp(f"plain-{layout}-{schedule}")
            _train(out, *LAYOUTS[layout][0], "--schedule", schedule)
            made[layout, schedule] = out
        return made[layout, schedule]

    return get


def _restarts(out: Path) -> list[tuple[int, int]]:
    """(attempt, resumed_from) of every attempt's first step."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["attempt"], r["resumed_from"]) for r in rows if r.get("event") == "first_step"]


@pytest.mark.parametrize("layout,schedule", CASES)
def test_a_killed_run_resumes_bit_for_bit(uninterrupted, tmp_path, layout, schedule):
    flags, rank = LAYOUTS[layout]
    plain = uninterrupted(layout, schedule)
    out = tmp_path / "killed"
    _train(out, *flags, "--schedule", schedule, "--max-restarts", "1",
           "--inject-fault", f"kill:rank={rank}:step=4")
    assert (1, 2) in _restarts(out), "the kill never fired, or the run did not resume from step 2"
    assert losses(out) == losses(plain)
    assert sorted(losses(out)) == list(range(1, 7))
    assert final_hash(out) == final_hash(plain)


@pytest.mark.parametrize("layout", ["local2", "dp2xlocal2"])
def test_two_local_stage_runs_with_dropout_are_bit_identical(uninterrupted, tmp_path, layout):
    """Without a fault, too: the same command twice, the same losses and parameters."""
    again = tmp_path / "again"
    _train(again, *LAYOUTS[layout][0], "--schedule", "1f1b")
    plain = uninterrupted(layout, "1f1b")
    assert losses(again) == losses(plain)
    assert final_hash(again) == final_hash(plain)
