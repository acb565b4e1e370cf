"""How long a snapshot stops training: written at once against written in the background, for a
GPT whose state (parameters and AdamW's) is over 500 MB, on dp 2, shard 2 and pp 2.

    python -m brigade.results.snapshot_stall --out results/snapshots   (about 15 minutes on 2 cores)
    python -m brigade.results.snapshot_stall --tiny --out /tmp/s        (tests this script)

Each layout runs the same `brigade train` three times: without snapshots (`--snapshot-every 0`:
only the last, after the steps measured), with a snapshot every 10 steps written at once
(`--no-snapshot-async`), and every 10 steps in the background (the default). From each run's
metrics:

    stall        the seconds a periodic snapshot held the step loop (its "snapshot" event): at
                 once, the whole write (DCP, checksums, parameters read back and hashed, the
                 rename); in the background, the copy to memory and the ranks' agreement
    written      (background) the seconds from the call until rank 0 marked it complete
    run          the steps' times (each step's `step_time_s`, the first left out) plus the
                 periodic snapshots' stalls: a background write slows the steps it overlaps,
                 which this counts
    slow-down    run ÷ the run without snapshots − 1

The state is the size of the last snapshot on disk (DCP writes a replicated tensor once). The
goal: a background stall at most 20 % of the stall at once. Two processes on this machine's 2
cores, one thread each; writes go to the local disk, whose page cache absorbs them.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from brigade.errors import RunError
from brigade.results import script
from brigade.train.metrics import events, read_records, training

GPT = ["--n-layer", "6", "--n-embd", "768", "--n-head", "12", "--context", "64", "--block-size", "64",
       "--batch-size", "4", "--microbatches", "2"]
TINY_GPT = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--context", "32", "--block-size", "32",
            "--batch-size", "4", "--microbatches", "2"]
QUIET = ["--eval-every", "100000", "--eval-batches", "1", "--sample-tokens", "0", "--warmup-steps", "5"]
LAYOUTS = {"dp 2": ["--nproc", "2"], "shard 2": ["--nproc", "2", "--shard", "2"],
           "pp 2": ["--nproc", "2", "--pp", "2"]}
TINY_LAYOUT = "shard 2"  # --tiny's one layout (3 runs instead of 9)
MODES = {"none": ["--snapshot-every", "0"], "sync": ["--no-snapshot-async"], "async": ["--snapshot-async"]}
GOAL = 0.20  # the background stall's share of the stall at once


def run(model: list[str], layout: str, mode: str, steps: int, every: int) -> dict:
    """One `brigade train`: its stalls, background write times, step times and state size."""
    flags = [*model, *QUIET, *LAYOUTS[layout], "--max-steps", str(steps), "--snapshot-every", str(every),
             *MODES[mode]]
    with tempfile.TemporaryDirectory(prefix="brigade-stall-") as tmp:
        done = subprocess.run([sys.executable, "-m", "brigade", "train", "--out", tmp, *flags],
                              capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
            raise RunError(f"brigade train {' '.join(flags)}: exit {done.returncode}: {tail}")
        recs = read_records(Path(tmp))
        last = max(p for p in (Path(tmp) / "snapshots").iterdir() if p.name.startswith("step_"))
        state = sum(f.stat().st_size for f in last.iterdir() if f.suffix == ".distcp")
    periodic = [e for e in events(recs, "snapshot") if e["step"] < steps]
    step_s = [r["step_time_s"] for r in training(recs) if r["step"] > 1]
    stalls = [e["seconds"] for e in periodic]
    return {"layout": layout, "mode": mode, "state_bytes": state, "snapshots": len(periodic),
            "stall_s": stalls, "written_s": [e["seconds"] for e in events(recs, "snapshot_written")
                                             if e["snapshot_step"] < steps],
            "step_s_median": statistics.median(step_s), "run_s": sum(step_s) + sum(stalls)}


def compare(rows: list[dict]) -> list[dict]:
    """Per layout: the mean stall at once and in the background, their ratio, each slow-down."""
    out = []
    for layout in dict.fromkeys(r["layout"] for r in rows):
        got = {r["mode"]: r for r in rows if r["layout"] == layout}
        sync, bg, none = (statistics.mean(got[m]["stall_s"]) if got[m]["stall_s"] else 0.0
                          for m in ("sync", "async", "none"))
        out.append({"layout": layout, "state_mb": got["sync"]["state_bytes"] / 1e6,
                    "stall_sync_s": sync, "stall_async_s": bg, "ratio": bg / sync,
                    "written_async_s": statistics.mean(got["async"]["written_s"]),
                    "slowdown_sync": got["sync"]["run_s"] / got["none"]["run_s"] - 1,
                    "slowdown_async": got["async"]["run_s"] / got["none"]["run_s"] - 1})
        assert none == 0.0, "the run without snapshots took one"
    return out


def plot(result: dict, path: Path) -> None:
    """The stall per snapshot, at once and in the background, per layout; and each slow-down."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["table"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(rows))
    left.bar([i - 0.2 for i in x], [r["stall_sync_s"] for r in rows], 0.4, label="at once", color="#c44e52")
    left.bar([i + 0.2 for i in x], [r["stall_async_s"] for r in rows], 0.4, label="in the background",
             color="#55a868")
    for i, r in enumerate(rows):
        left.text(i + 0.2, r["stall_async_s"], f"{r['ratio']:.0%}", ha="center", va="bottom", fontsize=8)
    left.set_xticks(list(x), [f"{r['layout']}\n{r['state_mb']:.0f} MB" for r in rows])
    left.set_ylabel("step stall per snapshot (s)")
    left.legend(fontsize=8)
    right.bar([i - 0.2 for i in x], [100 * r["slowdown_sync"] for r in rows], 0.4, label="at once",
              color="#c44e52")
    right.bar([i + 0.2 for i in x], [100 * r["slowdown_async"] for r in rows], 0.4,
              label="in the background", color="#55a868")
    right.set_xticks(list(x), [r["layout"] for r in rows])
    right.set_ylabel(f"slow-down of the run, a snapshot every {result['every']} steps (%)")
    right.legend(fontsize=8)
    fig.suptitle("snapshots: the stall at once against in the background (GPT, 2 processes on 2 cores)",
                 fontsize=9)
    script.close(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = script.parser("python -m brigade.results.snapshot_stall", __doc__, "results/snapshots",
                      "snapshot_stall.json and snapshot_stall.png",
                      "a GPT of 2 × 64, 6 steps, every 3, on shard 2 alone")
    args = p.parse_args(argv)
    model, steps, every = (TINY_GPT, 6, 3) if args.tiny else (GPT, 31, 10)
    # --tiny tests the script, not brigade: each layout is the same three runs with other flags
    layouts = [TINY_LAYOUT] if args.tiny else list(LAYOUTS)
    rows = []
    for layout in layouts:
        for mode in MODES:
            rows.append(run(model, layout, mode, steps, every))
            r = rows[-1]
            print(f"{layout:8s} {mode:5s}: state {r['state_bytes'] / 1e6:6.1f} MB, stalls "
                  f"{[round(s, 3) for s in r['stall_s']]} s, step {r['step_s_median'] * 1e3:6.0f} ms, "
                  f"run {r['run_s']:6.1f} s", flush=True)
    table = compare(rows)
    for r in table:
        print(f"{r['layout']:8s}: stall {r['stall_sync_s']:.3f} s at once, {r['stall_async_s']:.3f} s in the "
              f"background ({r['ratio']:.1%}); slow-down {r['slowdown_sync']:.1%} against "
              f"{r['slowdown_async']:.1%}", flush=True)
    result = {"command": "python -m brigade.results.snapshot_stall" + (" --tiny" if args.tiny else ""),
              "model": model, "steps": steps, "every": every, "goal": GOAL, "runs": rows, "table": table}
    script.save(result, args.out, "snapshot_stall", plot)
    return 0


if __name__ == "__main__":
    script.run(main, "python -m brigade.results.snapshot_stall")
