"""Kill campaigns: random kills on the layouts of every axis added since the first campaign, each
run ended bit for bit where its uninterrupted twin ends, snapshots written in the background.

    python -m brigade.results.kill_campaign --out results/faults     (about 30 minutes on 2 cores)
    python -m brigade.results.kill_campaign --tiny --out /tmp/k       (tests this script)

A layout is run under a zero-bubble schedule (zb, or zbv where it places both ends of the
model on one rank) and under 1f1b. Each trial is one `brigade train --max-restarts 1` of a tiny
GPT with dropout (8 steps, a snapshot every 2, in the background: the default), killed once in
one of three ways, the kind, rank and moment drawn from a seeded generator:

    step      `--inject-fault kill:rank=R:step=S`: rank R SIGKILLs itself as step S begins
    snapshot  `--inject-fault kill-during-snapshot:rank=R:step=S`: rank R SIGKILLs itself as it
              starts writing its part of snapshot S, in the background, while the others train on
    outside   SIGKILL sent from outside to the worker of rank R, a random moment after step S
              was logged: anywhere in a step, a transfer or a snapshot

The agent restarts every worker; they resume from the newest complete snapshot. A trial counts
as bit-identical when its final parameters' hash (`params_sha256`) and every step's loss equal
those of the same command never killed (each layout and schedule's twin, run first).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from brigade.errors import RunError
from brigade.results import script
from brigade.train.metrics import read_records

RUN = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--context", "16", "--block-size", "16",
       "--batch-size", "8", "--microbatches", "2", "--dropout", "0.1", "--seed", "21",
       "--max-steps", "8", "--snapshot-every", "2", "--eval-every", "100", "--eval-batches", "1",
       "--sample-tokens", "0", "--warmup-steps", "2"]
STEPS, EVERY = 8, 2
# layout: its flags and its zero-bubble schedule (zbv where the V puts both ends on one rank)
LAYOUTS = {
    "shard2xpp2": (["--nproc", "4", "--pp", "2", "--shard", "2"], "zb"),
    "tp2xpp2": (["--nproc", "4", "--pp", "2", "--tp", "2"], "zbv"),
    "hsdp2x2xpp2": (["--nproc", "8", "--pp", "2", "--shard", "2"], "zb"),
    "ep2xpp2": (["--nproc", "4", "--pp", "2", "--experts", "4", "--ep", "2", "--shard", "2"], "zbv"),
    "cp2xpp2": (["--nproc", "4", "--pp", "2", "--cp", "2"], "zb"),
}
KINDS = ("step", "snapshot", "outside")


@dataclass(frozen=True)
class Trial:
    layout: str
    schedule: str
    kind: str
    rank: int
    step: int  # the step it is killed at (outside: after which it is killed)
    delay: float = 0.0  # outside: seconds after that step was logged

    def flags(self) -> list[str]:
        return [*RUN, *LAYOUTS[self.layout][0], "--schedule", self.schedule]


def nproc(layout: str) -> int:
    flags = LAYOUTS[layout][0]
    return int(flags[flags.index("--nproc") + 1])


def plan(layouts: list[str], per_layout: int, seed: int) -> list[Trial]:
    """`per_layout` trials a layout, its two schedules and the three kinds taken in turn."""
    rng = random.Random(seed)
    trials = []
    for layout in layouts:
        schedules = (LAYOUTS[layout][1], "1f1b")
        for i in range(per_layout):
            kind = KINDS[(i + layouts.index(layout)) % len(KINDS)]
            rank = rng.randrange(nproc(layout))
            if kind == "snapshot":
                trials.append(Trial(layout, schedules[i % 2], kind, rank, rng.randrange(EVERY, STEPS, EVERY)))
            elif kind == "step":
                trials.append(Trial(layout, schedules[i % 2], kind, rank, rng.randint(2, STEPS)))
            else:
                trials.append(Trial(layout, schedules[i % 2], kind, rank, rng.randint(1, STEPS - 3),
                                    round(rng.uniform(0.0, 0.3), 3)))
    return trials


def _brigade(out: Path, flags: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "brigade", "train", "--out", str(out), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, what: str, limit: float = 600) -> str:
    """Wait for a run to end; its output, or RunError naming it when it failed."""
    stdout, stderr = proc.communicate(timeout=limit)
    if proc.returncode != 0:
        tail = (stderr.strip() or stdout.strip() or "no output").splitlines()[-1]
        raise RunError(f"{what}: exit {proc.returncode}: {tail}")
    return stdout


def outcome(out: Path) -> dict:
    """What a finished run ended with: its params_sha256 and every step's (last) loss."""
    manifest = json.loads((out / "snapshots" / (out / "snapshots" / "LATEST").read_text().strip()
                           / "manifest.json").read_text())
    return {"params_sha256": manifest["params_sha256"],
            "losses": {r["step"]: r["loss"] for r in read_records(out, missing_ok=True) if "loss" in r}}


def twin(root: Path, layout: str, schedule: str) -> dict:
    """The run never killed (trained once per layout and schedule)."""
    out = root / f"twin-{layout}-{schedule}"
    if not (out / "snapshots" / "LATEST").is_file():
        flags = [*RUN, *LAYOUTS[layout][0], "--schedule", schedule]
        _finish(_brigade(out, flags), f"twin {layout} {schedule}")
    return outcome(out)


def run_trial(root: Path, index: int, t: Trial) -> dict:
    """One trial, killed as `t` says; what it ended with and how it got there."""
    out = root / f"trial-{index:02d}-{t.layout}-{t.schedule}-{t.kind}"
    fault = {"step": f"kill:rank={t.rank}:step={t.step}",
             "snapshot": f"kill-during-snapshot:rank={t.rank}:step={t.step}"}.get(t.kind)
    flags = [*t.flags(), "--max-restarts", "1", *(["--inject-fault", fault] if fault else [])]
    start = time.monotonic()
    proc = _brigade(out, flags)
    killed = _kill_from_outside(out, proc, t) if t.kind == "outside" else True
    said = _finish(proc, f"trial {index} ({t.kind} rank {t.rank} step {t.step})")
    firsts = [r for r in read_records(out, missing_ok=True) if r.get("event") == "first_step"]
    died = re.search(r"rank (\d+) died", said)
    return {**asdict(t), "killed": killed, "died": int(died[1]) if died else None,
            "restarts": max((r["attempt"] for r in firsts), default=0),
            "resumed_from": [r["resumed_from"] for r in firsts if r["attempt"] > 0],
            "seconds": round(time.monotonic() - start, 1), **outcome(out)}


def _kill_from_outside(out: Path, proc: subprocess.Popen, t: Trial, limit: float = 300) -> bool:
    """SIGKILL rank `t.rank`'s worker `t.delay` s after step `t.step` was logged; False when the
    run ended first."""
    end = time.monotonic() + limit
    while proc.poll() is None and time.monotonic() < end:
        if any("loss" in r and r["step"] >= t.step for r in read_records(out, missing_ok=True)):
            time.sleep(t.delay)
            pid = _worker_of(proc.pid, t.rank)
            if pid is None:
                return False
            os.kill(pid, signal.SIGKILL)
            return True
        time.sleep(0.01)
    return False


def _worker_of(parent: int, rank: int) -> int | None:
    """The pid of local rank `rank`'s worker under `parent`: its children that are not
    multiprocessing's helpers, in the order they were started (pid order), which is the ranks'.
    (Which rank died is read back from what the agent reports: `died`.)"""
    workers = []
    for child in Path("/proc").iterdir():
        if not child.name.isdigit():
            continue
        try:
            stat = (child / "stat").read_text()
            cmdline = (child / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"resource_tracker" not in cmdline:
            workers.append(int(child.name))
    workers.sort()
    return workers[rank] if rank < len(workers) else None


def table(trials: list[dict]) -> list[dict]:
    """Per layout: its trials, the kills that landed, how many ended bit-identical, the restarts."""
    rows = []
    for layout in dict.fromkeys(t["layout"] for t in trials):
        mine = [t for t in trials if t["layout"] == layout]
        rows.append({"layout": layout, "schedules": sorted({t["schedule"] for t in mine}),
                     "trials": len(mine), "killed": sum(t["killed"] for t in mine),
                     "bit_identical": sum(t["bit_identical"] for t in mine),
                     "restarts": sum(t["restarts"] for t in mine),
                     "by_kind": {k: sum(t["kind"] == k for t in mine) for k in KINDS}})
    return rows


def plot(result: dict, path: Path) -> None:
    """Trials per layout, split into bit-identical and not, with each kind's count; from the JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["table"]
    fig, ax = plt.subplots(figsize=(9, 4))
    names = [r["layout"] for r in rows]
    same = [r["bit_identical"] for r in rows]
    ax.bar(names, same, color="#55a868", label="bit-identical to the twin")
    ax.bar(names, [r["trials"] - s for r, s in zip(rows, same)], bottom=same, color="#c44e52",
           label="not")
    for i, r in enumerate(rows):
        kinds = ", ".join(f"{n} {k}" for k, n in r["by_kind"].items() if n)
        ax.text(i, r["trials"], f"{kinds}\n{r['restarts']} restarts", ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("trials (one kill each)")
    ax.set_ylim(0, max(r["trials"] for r in rows) * 1.35)
    ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("kill campaigns, snapshots in the background: every run against its uninterrupted twin",
                 fontsize=9)
    script.close(fig, path)


def campaign(root: Path, layouts: list[str], per_layout: int, seed: int) -> list[dict]:
    """Every trial of the plan, each compared with its twin; printed as it goes."""
    done = []
    for i, t in enumerate(plan(layouts, per_layout, seed)):
        ref = twin(root, t.layout, t.schedule)
        got = run_trial(root, i, t)
        got["bit_identical"] = got["params_sha256"] == ref["params_sha256"] and got["losses"] == ref["losses"]
        del got["losses"]
        done.append(got)
        print(f"{t.layout:12s} {t.schedule:5s} {t.kind:8s} rank {t.rank} step {t.step}: "
              f"{'killed' if got['killed'] else 'missed (the run ended first)'}, restarts {got['restarts']}"
              f" from {got['resumed_from']}, {'bit-identical' if got['bit_identical'] else 'DIFFERS'}"
              f" ({got['seconds']} s)", flush=True)
    return done


def main(argv: list[str] | None = None) -> int:
    import tempfile

    p = script.parser("python -m brigade.results.kill_campaign", __doc__, "results/faults",
                      "kill_campaign.json and kill_campaign.png", "one trial on shard 2 × pp 2")
    p.add_argument("--per-layout", type=int, default=10, help="trials per layout")
    p.add_argument("--seed", type=int, default=0, help="seed of the kinds, ranks and moments drawn")
    args = p.parse_args(argv)
    # --tiny tests the script (a trial and its twin); the full tier's short campaign
    # (tests/e2e/test_kill_campaign.py) runs two trials on every layout
    layouts = ["shard2xpp2"] if args.tiny else list(LAYOUTS)
    per = 1 if args.tiny else args.per_layout
    with tempfile.TemporaryDirectory(prefix="brigade-kills-") as tmp:
        trials = campaign(Path(tmp), layouts, per, args.seed)
    result = {"command": "python -m brigade.results.kill_campaign" + (" --tiny" if args.tiny else ""),
              "seed": args.seed, "per_layout": per, "run": RUN, "layouts": {k: LAYOUTS[k] for k in layouts},
              "trials": trials, "table": table(trials)}
    script.save(result, args.out, "kill_campaign", plot)
    return 0 if all(t["bit_identical"] for t in trials) else 1


if __name__ == "__main__":
    script.run(main, "python -m brigade.results.kill_campaign")
