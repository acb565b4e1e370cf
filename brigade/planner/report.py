"""The ranked table `brigade plan` prints, its one-line header, and for a mixture of experts a line
of its parameters in all and active."""

from __future__ import annotations

MIB = 2**20
COLUMNS = (
    "layout",
    "step ms",
    "tokens/s",
    "MFU",
    "bubble",
    "comm",
    "params",
    "grads",
    "optim",
    "activ",
    "peak MiB",
    "reserved",
    "fits",
    "source",
)


def _gib(b: float) -> str:
    return f"{b / MIB:.1f}"


def cells(row: dict) -> list[str]:
    m = row["memory"]
    fits = "yes" if row["fits"] else f"no, +{row['over_bytes'] / MIB:.0f} MiB"
    return [
        row["label"],
        f"{row['step_s'] * 1e3:.3g}",
        f"{row['tokens_per_s']:.0f}",
        f"{100 * row['mfu']:.1f} %",
        f"{row['bubble']:.2f}",
        f"{100 * row['comm_share']:.0f} %",
        _gib(m["params"]),
        _gib(m["grads"]),
        _gib(m["optimizer"]),
        _gib(m["activations"]),
        _gib(m["peak"]),
        _gib(m.get("reserved", m["peak"])),
        fits,
        row["source"],
    ]


def _count(n: float) -> str:
    return next(f"{n / d:.3g} {unit}" for d, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k"), (1, ""))
                if n >= d or d == 1)


def parameters(p: dict) -> str:
    """A mixture of experts' line: its parameters in all and those a token runs through."""
    experts = "/".join(map(str, p["experts"]))
    top = "/".join(map(str, p["top_k"]))
    return (f"parameters: {_count(p['total'])} in all (memory), {_count(p['active'])} active a token "
            f"(FLOPs): top {top} of {experts} experts in {p['moe_layers']} MoE layers")


def table(result: dict, top: int) -> str:
    """A header line, then the best `top` rows as aligned columns (memory: the busiest rank, MiB)."""
    rows = [list(COLUMNS), *(cells(r) for r in result["rows"][:top])]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = [
        f"brigade plan: {result['model']}, batch {result['batch_size']}, on {result['cluster']}: "
        f"{len(result['rows'])} layouts, costs {result['source']} (memory per rank, MiB)"
    ]
    if result.get("parameters"):
        lines.append(parameters(result["parameters"]))
    for r in rows:
        lines.append(
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        )
    if result["left_out"]:
        lines.append(
            f"left out: {len(result['left_out'])} layouts the schedules cannot run "
            f"(first: {result['left_out'][0]['label']}: {result['left_out'][0]['reason']})"
        )
    return "\n".join(lines)
