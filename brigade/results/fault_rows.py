"""docs/results.md's rows for snapshots written in the background and the kill campaigns
(results/snapshots/, results/faults/kill_campaign.json), rendered with the page's rounding."""

from __future__ import annotations

from brigade.results.rows import Row, adder

ROWS: list[Row] = []
row = adder(ROWS)


@row("a snapshot's stall, written at once against in the background: GPT 6×768 (its state over 500 MB), "
     "a snapshot every 10 steps of 31, 2 processes on 2 cores, dp 2, shard 2 and pp 2",
     "snapshots/snapshot_stall.json", "`python -m brigade.results.snapshot_stall`")
def _stall(d: dict) -> str:
    return "; ".join(
        f"{r['layout']} ({r['state_mb']:.0f} MB): {r['stall_sync_s']:.2f} s at once, "
        f"{r['stall_async_s']:.2f} s in the background ({100 * r['ratio']:.0f} %; written "
        f"{r['written_async_s']:.1f} s after); run "
        f"slowed {100 * r['slowdown_sync']:.0f} % against {100 * r['slowdown_async']:.0f} %"
        for r in d["table"])


@row("kill campaigns, snapshots in the background: a kill at a random step, during a snapshot's write "
     "or from outside at a random moment, under a zero-bubble schedule and 1f1b, against each run's "
     "uninterrupted twin", "faults/kill_campaign.json", "`python -m brigade.results.kill_campaign`")
def _campaign(d: dict) -> str:
    return "; ".join(f"{r['layout']}: {r['bit_identical']} of {r['trials']} bit-identical "
                     f"({r['restarts']} restarts)" for r in d["table"])
