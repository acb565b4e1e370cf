"""loss.png from a run folder's metrics.jsonl (finished or not): matplotlib reads only the file."""

from __future__ import annotations

import json
from pathlib import Path

from brigade.errors import BrigadeError


def read_metrics(out: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    train, val = [], []
    path = out / "metrics.jsonl"
    if not path.is_file():
        raise BrigadeError(f"{out} has no metrics.jsonl: give the --out folder of a training run")
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if "loss" in r:
            train.append((r["step"], r["loss"]))
        if r.get("val_loss") is not None:
            val.append((r["step"], r["val_loss"]))
    return train, val


def plot_run(out: str | Path) -> Path | None:
    """Write out/loss.png (training and validation loss against step); returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    train, val = read_metrics(out)
    if not train and not val:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="training", linewidth=1, alpha=0.8)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", linewidth=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{out.name}: loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / "loss.png"
    tmp = out / ".loss.png.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path
