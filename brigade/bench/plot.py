"""Plots and tables from bench.json only: anyone can redraw them from the file."""

from __future__ import annotations

import json
from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def typical(row: dict) -> float:
    """A row's step time: the median over rounds (files before the rounds: the mean)."""
    return row.get("median_s", row["mean_s"])


def spread(row: dict) -> tuple[float, float]:
    """Error bar below and above `typical`: the median's CI (before the rounds: ± std)."""
    if "median_ci" in row:
        lo, hi = row["median_ci"]
        return row["median_s"] - lo, hi - row["median_s"]
    return row["std_s"], row["std_s"]


def best(configs: list[dict], **match) -> dict | None:
    """The fastest row (by `typical`) whose fields equal `match`."""
    rows = [c for c in configs if all(c.get(k) == v for k, v in match.items())]
    return min(rows, key=typical) if rows else None


def label(row: dict) -> str:
    """``1f1b m=8``, ``interleaved V=2 m=8``: a row's schedule as the table and plots show it."""
    v = f" V={row['virtual']}" if row.get("virtual", 1) > 1 else ""
    return f"{row['schedule'] or ''}{v} m={row['microbatches']}"


def headline(configs: list[dict]) -> list[tuple[str, dict]]:
    picks = [("Single device", best(configs, name="single")),
             ("Model parallel", best(configs, name="model parallel")),
             ("brigade pipelined (best)", best(configs, name="brigade")),
             ("torch pipelining (best)", best(configs, name="torch.distributed.pipelining")),
             ("DDP", best(configs, name="ddp"))]
    return [(label, row) for label, row in picks if row is not None]


def bar_chart(data: dict, path: Path) -> None:
    plt = _plt()
    picks = headline(data["configs"])
    fig, ax = plt.subplots(figsize=(8, 4.2))
    means = [typical(r) for _, r in picks]
    bars = list(zip(*(spread(r) for _, r in picks)))
    ax.bar(range(len(picks)), means, yerr=bars, capsize=8, alpha=0.6, ecolor="red", width=0.6)
    labels = [f"{what}\n{label(r)}" if r["schedule"] else what for what, r in picks]
    ax.set_xticks(range(len(picks)), labels, fontsize=8)
    ax.set_ylabel(f"{data['config']['model']} step time (s)")
    ax.yaxis.grid(True)
    ax.set_title(f"{data['config']['model']}, batch {data['config']['batch_size']}, {data['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def split_curve(data: dict, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    series = {}
    for c in data["configs"]:
        if c["name"] in ("brigade", "torch.distributed.pipelining"):
            v = f" V={c['virtual']}" if c.get("virtual", 1) > 1 else ""
            name = f"{'brigade' if c['name'] == 'brigade' else 'torch'} {c['schedule']}{v}"
            series.setdefault(name, []).append(c)
    for name, rows in sorted(series.items()):
        rows.sort(key=lambda c: c["split_size"])
        ax.errorbar([c["split_size"] for c in rows], [typical(c) for c in rows],
                    yerr=list(zip(*(spread(c) for c in rows))), marker="o", capsize=4,
                    linestyle="--" if name.startswith("torch") else "-", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("pipeline split size (samples per micro-batch)")
    ax.set_ylabel("step time (s)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("split-size trade-off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#dd8452", "W": "#c44e52", "comm": "#8c8c8c"}


def _kind(name: str) -> str:
    op = name.lstrip("0123456789").rstrip("0123456789")
    return "comm" if op.startswith(("SEND", "RECV")) else op


def timeline(data: dict, path: Path, trace_path: Path) -> None:
    """Gantt of one traced pipelined step (the fastest), and the same as a Chrome trace."""
    tl = data.get("timeline")
    if not tl:
        return
    plt = _plt()
    events = tl["events"]
    end = max(e for rank in events for _, _, e in rank)
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.8 * len(events)))
    for rank, rows in enumerate(events):
        ax.broken_barh([(0, end * 1e3)], (rank - 0.4, 0.8), facecolors="#eeeeee")  # idle
        for name, s, e in rows:
            ax.broken_barh([(s * 1e3, max((e - s) * 1e3, 0.05))], (rank - 0.4, 0.8),
                           facecolors=_COLOURS.get(_kind(name), "#55a868"))
            if _kind(name) != "comm" and (e - s) > end / 40:
                ax.text((s + e) / 2 * 1e3, rank, name, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(events)), [f"rank {r}" for r in range(len(events))])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in
               (_COLOURS["F"], _COLOURS["B"], _COLOURS["W"], _COLOURS["comm"], "#eeeeee")]
    ax.legend(handles, ["forward", "backward (or its input half)", "backward (weight half)",
                        "send/recv", "idle"], fontsize=7, loc="upper center", ncol=5,
              bbox_to_anchor=(0.5, -0.35 if len(events) < 3 else -0.15))
    ax.set_title(f"one measured step: {label(tl)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    chrome = [{"name": name, "cat": _kind(name), "ph": "X", "ts": s * 1e6, "dur": (e - s) * 1e6,
               "pid": 0, "tid": rank} for rank, rows in enumerate(events) for name, s, e in rows]
    trace_path.write_text(json.dumps({"traceEvents": chrome, "displayTimeUnit": "ms"}))


def memory_chart(data: dict, path: Path) -> None:
    rows = [c for c in data["configs"] if c["name"] == "brigade" and c.get("peak_activation_bytes")]
    if not rows:
        return
    m = max(c["microbatches"] for c in rows)
    rows = sorted((c for c in rows if c["microbatches"] == m), key=lambda c: c["schedule"])
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(rows)
    for k, c in enumerate(rows):
        peaks = [b / 2**20 for b in c["peak_activation_bytes"]]
        v = f" V={c['virtual']}" if c.get("virtual", 1) > 1 else ""
        ax.bar([s + k * width for s in range(len(peaks))], peaks, width, label=c["schedule"] + v)
    ax.set_xticks([s + width * (len(rows) - 1) / 2 for s in range(len(rows[0]["peak_activation_bytes"]))],
                  [f"rank {s}" for s in range(len(rows[0]["peak_activation_bytes"]))])
    ax.set_ylabel("peak activation memory (MiB)")
    ax.set_title(f"activations held for backward, m={m}")
    ax.legend()
    ax.yaxis.grid(True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ratio(row: dict, key: str) -> str:
    """``1.12`` for a ranked ratio, ``1.02?`` when its CI crosses 1 (the two cannot be ranked)."""
    value = row.get(key)
    if value is None:
        return "-"
    return f"{value:.2f}" + ("?" if row.get(f"{key}_ranked") is False else "")


def table(data: dict) -> str:
    """The rows as text: median step, its CI, and ratios per round (``?``: CI crosses 1)."""
    head = f"{'configuration':<30}{'schedule':>14}{'m':>4}{'median s':>10}{'95% CI':>17}" \
           f"{'speedup':>9}{'ideal':>7}{'eff':>7}{'vs torch':>10}"
    lines = [head, "-" * len(head)]
    for c in data["configs"]:
        lo, hi = spread(c)
        v = f" V{c['virtual']}" if c.get("virtual", 1) > 1 else ""
        ideal = f"{c['ideal_speedup']:.2f}" if c.get("ideal_speedup") is not None else "-"
        lines.append(f"{c['name'][:29]:<30}{(c['schedule'] or '-') + v:>14}{c['microbatches']:>4}"
                     f"{typical(c):>10.4f}{f'{typical(c) - lo:.3f}–{typical(c) + hi:.3f}':>17}"
                     f"{_ratio(c, 'speedup_vs_single'):>9}{ideal:>7}{_ratio(c, 'efficiency'):>7}"
                     f"{_ratio(c, 'vs_torch'):>10}")
    lines.append("? : the 95 % CI of that per-round ratio contains 1: the two sides cannot be ranked")
    return "\n".join(lines)


def cut_lines(data: dict) -> list[str]:
    """One line per cut a costed schedule (auto) chose with its plan (bench.json's "cut_search"):
    the cut against the solver's, each one's step as simulated on the blocks' measured costs."""
    out = []
    for name, found in data.get("cut_search", {}).items():
        how = "best over every cut" if found["proven"] else f"best of {found['screened']} cuts screened"
        out.append(f"{name}: cut {found['cut']} (the solver's {found['solver_cut']}), simulated "
                   f"{found['simulated_s']:.4f} s against {found['solver_simulated_s']:.4f} s ({how})")
    return out


def write_all(data: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench_bars.png", out / "split_size_tradeoff.png", out / "timeline.png",
             out / "memory.png"]
    bar_chart(data, paths[0])
    split_curve(data, paths[1])
    timeline(data, paths[2], out / "timeline_trace.json")
    memory_chart(data, paths[3])
    return [p for p in paths if p.exists()]
