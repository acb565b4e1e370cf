"""loss.png from a run folder's metrics.jsonl (finished or not): matplotlib reads only the file."""

from __future__ import annotations

from pathlib import Path

from brigade.train.metrics import read_records, training, validation


def loss_curves(records: list[dict]) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(step, loss) of the training steps and (step, val_loss) of the evaluations."""
    return ([(r["step"], r["loss"]) for r in training(records)],
            [(r["step"], r["val_loss"]) for r in validation(records)])


def plot_run(out: str | Path) -> Path | None:
    """Write out/loss.png (training and validation loss against step); returns its path, or None
    if there is nothing to plot yet.

    Raises:
        BrigadeError: `out` has no metrics.jsonl.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    train, val = loss_curves(read_records(out))
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
