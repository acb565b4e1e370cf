"""Exact resume is a property of every registered schedule: a run stopped mid-run and resumed from
its snapshot ends bit for bit where the run that never stopped ends.

The schedules come from the registry (`schedule.names()`), so one registered later is covered
by construction. Each runs under pp 2, dp 2 × pp 2, two local stages in one process and
dp 2 × two local stages, on a tied GPT with dropout: the V placements (zbv, dualpipev) put the
embedding's stage and the head's on one rank, the case a loader once got wrong (both copies of
the tie were handed one optimizer state, stepped twice). Local stages are threads of one
process that share its CPU generator, whose dropout masks once followed the threads' timing:
two runs that never stopped parted within a few steps (so they are also compared with each other).

Six steps, a snapshot every two (the runs that never stop: at the end only, so a snapshot taken
or not is shown to leave training as it is). Two ways to stop:

- **every schedule**, in one spawned world per layout (the processes start once and run every
  schedule's runs one after another, as `brigade train`'s workers run one: `train.run._train`
  on the same process groups): the run that never stopped; the same run stopped after step 3
  as SIGTERM stops it (the agreed stop flag: snapshot step 3, leave); and its resume, steps 4-6.
  What is under test, saving and loading a snapshot across ranks, is the same whatever stopped
  the run; starting the processes once per layout instead of twice per schedule is what keeps
  this under a minute a layout.
- **a kill**, through the CLI as a user types it, for one schedule per layout (a V schedule
  where the layout has one rank per stage): rank R SIGKILLed as step 4 begins, the agent
  restarts every worker, step 3 is lost and run again from the snapshot of step 2. Its end must
  equal the never-stopped run of the spawned world: the CLI's workers and `_train` in a shared
  world are one code path, and so give one result.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from brigade.pipeline.plans.schedule import names
from tests.e2e.helpers import final_hash, losses

# A layout's first case starts its world, which runs every schedule's three runs: under a loaded
# machine (the other xdist worker running several processes too) a world took over 300 s.
pytestmark = pytest.mark.timeout(600)
RUN = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--context", "16", "--block-size", "16",
       "--batch-size", "8", "--microbatches", "2", "--dropout", "0.1", "--seed", "21",
       "--max-steps", "6", "--snapshot-every", "2", "--eval-every", "100", "--eval-batches", "1",
       "--sample-tokens", "0", "--warmup-steps", "2", "--no-mfu"]
# layout flags; the rank to kill and the schedule it is killed under. Under dp 2 × pp 2 rank 2
# is the second replica's first pipeline rank, which under a V holds both ends of the model;
# under dp 2 × local stages rank 1 is the second replica (all its stages die with it); under shard 2 ×
# pp 2 rank 3 holds the second shard of the last stage; under tp 2 × pp 2 rank 3 holds the second
# half of the last pipeline rank's matmuls (under zbv: of both ends of the model); under ep 2 ×
# pp 2 (a mixture of 4 experts, 2 on each replica, sharded) rank 1 holds the first replica's
# half of the last stage's experts; under cp 2 × pp 2 rank 1 holds the second part of every sequence
# on the first pipeline rank.
LAYOUTS = {"pp2": (["--nproc", "2", "--pp", "2"], 1, "zbv"),
           "dp2xpp2": (["--nproc", "4", "--pp", "2"], 2, "dualpipev"),
           "local2": (["--nproc", "1", "--local-stages", "2"], 0, "1f1b"),
           "dp2xlocal2": (["--nproc", "2", "--local-stages", "2"], 1, "zbv"),
           "shard2xpp2": (["--nproc", "4", "--pp", "2", "--shard", "2"], 3, "zb"),
           "tp2xpp2": (["--nproc", "4", "--pp", "2", "--tp", "2"], 3, "zbv"),
           "ep2xpp2": (["--nproc", "4", "--pp", "2", "--experts", "4", "--ep", "2", "--shard", "2"], 1, "zb"),
           "cp2xpp2": (["--nproc", "4", "--pp", "2", "--cp", "2"], 1, "zb")}
STOP_AFTER = 3  # the stopped run's last step
LAST_ONLY = ["--snapshot-every", "6"]  # the never-stopped runs' snapshots: the last step's alone


# pp 2's world is the default tier's representative (two schedules, 1f1b and zbv, one world of 2
# processes; its other schedules' cases run in the full tier's world); the other layouts' worlds
# (40-260 s each) are the full tier's, which CI runs after the default.


# The worlds of 4 processes run one after another, on one xdist worker: two at once (8 processes
# on 2 cores, each holding the gloo groups of its 24 runs, some 600 threads a process) once drove
# the load past 300, and both worlds past their timeouts.
WIDE = "resume-4-processes"


def _group(layout: str) -> str:
    return WIDE if "4" in LAYOUTS[layout][0][:2] else f"resume-{layout}"


def _marks(layout: str) -> list:
    """On the xdist worker that holds the layout's world (one world per layout; the 4-process ones
    all on one, `WIDE`); the full tier but for pp 2's (tests/tiers.py names the representatives
    kept in the default)."""
    return [pytest.mark.xdist_group(_group(layout))]


CASES = [pytest.param(layout, name, id=f"{layout}-{name}", marks=_marks(layout))
         for layout in LAYOUTS for name in names()]


def _config(out: Path, layout: str, schedule: str, *more: str):
    """The configuration `brigade train --out OUT RUN LAYOUT --schedule S MORE` builds."""
    from brigade import config
    from brigade.cli import build_parser

    args = build_parser().parse_args(["train", "--out", str(out), *RUN, *LAYOUTS[layout][0],
                                      "--schedule", schedule, *more])
    return config.build(args)


def _stop_after(step: int):
    """`agent.stop_requested` as SIGTERM after `step` makes it: the run's after-step callback asks
    it once per step, then all ranks agree on the flag (train.snapshots.Snapshots.after_step)."""
    asked = [0]

    def stop_requested() -> bool:
        asked[0] += 1
        return asked[0] >= step

    return stop_requested


def _every_schedule(runs: dict) -> dict:
    """Worker: for each schedule, the never-stopped run, the stopped run and its resume, and (local
    layouts) the never-stopped run again; {schedule: {run: params sha256}} on every rank."""
    from brigade import forensics
    from brigade.launcher import agent, groups
    from brigade.train import run as train_run

    p = next(iter(runs.values()))["plain"].parallel
    info = groups.init(p.backend, p.threads, forensics.group_timeout(p.hang_timeout), p.local_stages)
    hashes: dict = {}
    try:
        for schedule, cfgs in runs.items():
            got = hashes[schedule] = {"plain": train_run._train(cfgs["plain"], info, None)["params_sha256"]}
            if "again" in cfgs:
                got["again"] = train_run._train(cfgs["again"], info, None)["params_sha256"]
            asked, agent.stop_requested = agent.stop_requested, _stop_after(STOP_AFTER)
            try:
                stopped = train_run._train(cfgs["stopped"], info, None)
            finally:
                agent.stop_requested = asked
            assert stopped["preempted"] and stopped["step"] == STOP_AFTER, stopped
            got["resumed"] = train_run._train(cfgs["stopped"], info, None)["params_sha256"]
    finally:
        groups.destroy()
    return hashes


def _selected(session, layout: str) -> list[str]:
    """The schedules this session's tests of `layout` need: its selected cases' (the default tier
    keeps two of pp 2's, `tests/tiers.py`; the full tier the rest), and the kill's, where its
    test is selected; every schedule where none is."""
    wanted = set()
    for item in session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("layout") == layout and item.originalname == "test_a_stopped_run_resumes_bit_for_bit":
            wanted.add(params["schedule"])
        elif params.get("layout") == layout and item.originalname.startswith("test_a_killed_run"):
            wanted.add(LAYOUTS[layout][2])
    return [s for s in names() if s in wanted] or names()


@pytest.fixture(scope="session")
def worlds(tmp_path_factory, request):
    """Per layout, on first use: one spawned world that runs the three runs of every schedule the
    session's selected tests need (`_selected`). Session scoped: an xdist worker runs other
    modules' tests between a layout's cases, and a module scoped fixture would be torn down (and
    its world started again) at each such switch."""
    from brigade.launcher import agent

    made: dict[str, tuple[Path, dict] | BaseException] = {}

    def get(layout: str) -> tuple[Path, dict]:
        if layout not in made:
            root = tmp_path_factory.mktemp(f"resume-{layout}")
            local = "--local-stages" in LAYOUTS[layout][0]
            # The runs that never stop snapshot only at their end (the stopped one every 2 steps):
            # fewer writes, and a proof that snapshots taken or not leave training as it is.
            runs = {s: {"plain": _config(root / s / "plain", layout, s, *LAST_ONLY),
                        "stopped": _config(root / s / "stopped", layout, s),
                        **({"again": _config(root / s / "again", layout, s, *LAST_ONLY)} if local else {})}
                    for s in _selected(request.session, layout)}
            nproc = next(iter(runs.values()))["plain"].parallel.nproc
            try:
                made[layout] = root, agent.launch(_every_schedule, nproc, runs)[0]
            except (Exception, pytest.fail.Exception) as exc:  # a timeout too: every case of the
                made[layout] = exc  # layout fails with it once, not one world (and timeout) each
        if isinstance(made[layout], BaseException):
            raise made[layout]
        return made[layout]

    return get


@pytest.mark.parametrize("layout,schedule", CASES)
def test_a_stopped_run_resumes_bit_for_bit(worlds, layout, schedule):
    root, hashes = worlds(layout)
    plain, stopped = root / schedule / "plain", root / schedule / "stopped"
    assert _first_steps(stopped) == [(0, 0), (0, STOP_AFTER)], "the run did not resume from its stop"
    assert losses(stopped) == losses(plain)
    assert sorted(losses(stopped)) == list(range(1, 7))
    assert hashes[schedule]["resumed"] == hashes[schedule]["plain"]
    assert final_hash(plain) == final_hash(stopped) == hashes[schedule]["plain"]
    if "again" in hashes[schedule]:  # local stages: the same run twice, the same parameters
        assert hashes[schedule]["again"] == hashes[schedule]["plain"]
        assert losses(root / schedule / "again") == losses(plain)


def _first_steps(out: Path) -> list[tuple[int, int]]:
    """(attempt, resumed_from) of every attempt's first step."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["attempt"], r["resumed_from"]) for r in rows if r.get("event") == "first_step"]


@pytest.mark.parametrize("layout", [pytest.param(name, marks=_marks(name)) for name in LAYOUTS])
def test_a_killed_run_restarted_by_the_agent_resumes_bit_for_bit(worlds, tmp_path, layout):
    """`brigade train` through the CLI's `main` in this process (no `brigade` process start; the
    same agent, workers and restarts), a rank killed as step 4 begins."""
    from brigade.cli import main

    flags, rank, schedule = LAYOUTS[layout]
    root, _ = worlds(layout)
    out = tmp_path / "killed"
    assert main(["train", "--out", str(out), *RUN, *flags, "--schedule", schedule, "--max-restarts", "1",
                 "--inject-fault", f"kill:rank={rank}:step=4"]) == 0
    assert (1, 2) in _first_steps(out), "the kill never fired, or the run did not resume from step 2"
    plain = root / schedule / "plain"
    assert losses(out) == losses(plain)
    assert final_hash(out) == final_hash(plain)


# Ten kills under shard 2 × pp 2 (zb), every rank, steps 2 to 6 (snapshots every 2 steps: some
# resume from a snapshot, the step-2 kills from the start): each must end bit-identical.
KILLS = [(0, 2), (1, 3), (2, 4), (3, 5), (0, 6), (1, 4), (2, 3), (3, 2), (0, 5), (1, 6)]


@pytest.mark.full
@pytest.mark.xdist_group(WIDE)
@pytest.mark.parametrize("rank,step", KILLS, ids=[f"rank{r}-step{s}" for r, s in KILLS])
def test_the_kill_campaign_under_shard_2_x_pp_2(worlds, tmp_path, rank, step):
    from brigade.cli import main

    flags, _, schedule = LAYOUTS["shard2xpp2"]
    root, _ = worlds("shard2xpp2")
    out = tmp_path / "killed"
    assert main(["train", "--out", str(out), *RUN, *flags, "--schedule", schedule, "--max-restarts", "1",
                 "--inject-fault", f"kill:rank={rank}:step={step}"]) == 0
    assert [a for a, _ in _first_steps(out)] == [0, 1], "the kill never fired, or no restart"
    plain = root / schedule / "plain"
    assert losses(out) == losses(plain)
    assert final_hash(out) == final_hash(plain)


@pytest.mark.full
@pytest.mark.timeout(400)
def test_a_measured_cut_is_kept_so_a_restart_goes_on_exactly(tmp_path):
    """--balance measured: auto's cut is measured once, at the run's start, and kept in its
    snapshots; killed and restarted, the run cuts by the snapshot's cut instead of measuring again,
    and ends bit for bit where a run given that cut from the start, never stopped, ends."""
    from tests.e2e.helpers import train

    flags = [*RUN, "--n-layer", "4", "--nproc", "2", "--pp", "2", "--schedule", "auto"]  # cuts to choose
    measured = train(tmp_path / "measured", *flags, "--balance", "measured",
                     "--inject-fault", "kill:rank=1:step=4", "--max-restarts", "1")
    assert measured.returncode == 0, measured.stderr[-2000:]
    said = [line for line in measured.stdout.splitlines() if "--balance measured:" in line]
    assert len(said) == 1, measured.stdout  # measured once; the restart read the snapshot's cut
    cut = json.loads((tmp_path / "measured" / "snapshots" / "step_00000006" / "manifest.json").read_text())
    given = train(tmp_path / "given", *flags, "--balance", ",".join(map(str, cut["balance"])))
    assert given.returncode == 0, given.stderr[-2000:]
    assert final_hash(tmp_path / "measured") == final_hash(tmp_path / "given")
