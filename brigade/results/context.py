"""Context parallel on this machine: each rank's activations at sequence 1024 under cp 1, 2 and 4,
and the longest sequence that trains within a fixed memory limit at each cp.

    python -m brigade.results.context --out results/context        (about 15 minutes on 2 cores)
    python -m brigade.results.context --tiny --out /tmp/c           (tests this script)

The model: the built-in GPT, 2 blocks of width 64, 4 heads, a batch of 2 sequences, one
micro-batch, trained for 3 steps by `brigade train` with `--nproc C --cp C` (dp 1: every process
holds a C-th of each sequence; attention by all-to-all, the one method a CPU runs). Measured
(`train.memory`, step 2): each rank's `activations` (the most held for the backward at once)
and `peak` (everything allocated at once, parameters, gradients and AdamW's state included).

The limit. A run "fits" when every rank's measured peak is at most `LIMIT` bytes (the limit is
applied to the measured peak, not enforced by the operating system). For each cp the sequence
doubles from 1024 until a run does not fit, then the gap is halved twice: the longest length that
fit is the row's. The step times are 4 processes on 2 cores at cp 4: the machine's, not a GPU's.
"""

from __future__ import annotations

from pathlib import Path

from brigade.results import script
from brigade.results.plan_accuracy import _flags, train

GPT = {"n_layer": 2, "n_embd": 64, "n_head": 4, "batch_size": 2}
LIMIT = 64 * 2**20  # bytes: the fixed memory limit per rank (module docstring)
TINY_LIMIT = 6 * 2**20
CPS = (1, 2, 4)
TINY_CPS = (1, 2)


def run(cp: int, seq: int, steps: int = 3) -> dict:
    """`brigade train` of the GPT at sequence `seq` over `cp` processes: each rank's figures."""
    model = _flags({"model": "gpt", **GPT, "context": seq, "block_size": seq, "nproc": cp, "cp": cp,
                    "microbatches": 1, "eval_every": 1000, "sample_tokens": 0})
    got = train(model, steps)
    return {"cp": cp, "seq": seq, "activations": max(got["activations"]), "peak": max(got["peak"]),
            "step_s": got["step_s"]}


def longest(cp: int, limit: int, first: dict, halvings: int = 2) -> dict:
    """The longest sequence (a multiple of 2·cp) whose run fits `limit` (module docstring), from
    the run `first` on, and every run tried on the way."""
    tried, seq = [first], first["seq"]
    while tried[-1]["peak"] <= limit:
        seq *= 2
        tried.append(run(cp, seq))
    fits = [r["seq"] for r in tried if r["peak"] <= limit]
    low, high = (max(fits) if fits else 0), tried[-1]["seq"]
    for _ in range(halvings):
        mid = (low + high) // 2 // (2 * cp) * (2 * cp)
        if mid in (low, high) or mid <= 0:
            break
        tried.append(run(cp, mid))
        low, high = (mid, high) if tried[-1]["peak"] <= limit else (low, mid)
    return {"cp": cp, "longest": low, "limit": limit, "tried": sorted(tried, key=lambda r: r["seq"])}


def plot(result: dict, path: Path) -> None:
    """Activations at sequence 1024 by cp, and the peak against the sequence length at each cp
    with the limit, from the JSON alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = result["at_1024"]
    left.bar([str(r["cp"]) for r in rows], [r["activations"] / 2**20 for r in rows], color="#4c72b0")
    for i, r in enumerate(rows):
        left.text(i, r["activations"] / 2**20, f"{r['ratio']:.3f}", ha="center", va="bottom", fontsize=8)
    left.set_xlabel("cp (processes a sequence is split over)")
    left.set_ylabel(f"activations per rank at sequence {result['seq']} (MiB)")
    for row in result["longest"]:
        tried = row["tried"]
        right.plot([r["seq"] for r in tried], [r["peak"] / 2**20 for r in tried], "o-",
                   label=f"cp {row['cp']}: longest {row['longest']}")
    right.axhline(result["limit"] / 2**20, color="#c44e52", ls="--", label="limit")
    right.set_xscale("log", base=2)
    right.set_xlabel("sequence length")
    right.set_ylabel("peak per rank (MiB)")
    right.legend(fontsize=8)
    fig.suptitle("GPT (2 × 64) under context parallel (all-to-all), this machine", fontsize=9)
    script.close(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = script.parser("python -m brigade.results.context", __doc__, "results/context",
                      "context.json and context.png", "cp 1 and 2, sequence 128, a smaller limit")
    args = p.parse_args(argv)
    seq, limit, cps = (128, TINY_LIMIT, TINY_CPS) if args.tiny else (1024, LIMIT, CPS)
    at = [run(cp, seq) for cp in cps]
    for r in at:
        r["ratio"] = r["activations"] / at[0]["activations"]
        print(f"cp {r['cp']}: activations {r['activations'] / 2**20:6.2f} MiB ({r['ratio']:.3f} of cp 1), "
              f"peak {r['peak'] / 2**20:6.2f} MiB, step {r['step_s'] * 1e3:6.1f} ms", flush=True)
    rows = []
    for first in at:
        cp = first["cp"]
        rows.append(longest(cp, limit, first, halvings=0 if args.tiny else 2))
        print(f"cp {cp}: the longest sequence within {limit / 2**20:.0f} MiB: {rows[-1]['longest']}",
              flush=True)
    result = {"gpt": GPT, "seq": seq, "limit": limit, "at_1024": at, "longest": rows,
              "method": "all-to-all",
              "command": "python -m brigade.results.context" + (" --tiny" if args.tiny else "")}
    script.save(result, args.out, "context", plot)
    return 0


if __name__ == "__main__":
    script.run(main, "python -m brigade.results.context")
