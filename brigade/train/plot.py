"""loss.png from a run folder's metrics.jsonl (finished or not), and experts.png where the model
has a mixture of experts (`train.experts`): matplotlib reads only the file."""

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
    path = _save(fig, out / "loss.png")
    plot_experts(out)
    return path


def _save(fig, path: Path) -> Path:
    """`fig` written to `path` whole or not at all (a temporary name, then a rename)."""
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def plot_experts(out: str | Path) -> Path | None:
    """Write out/experts.png: the balancing loss, the router's entropy and the worst imbalance
    against step, and the last step's share of each expert in each layer; None (nothing
    written) for a run without a mixture of experts."""
    import matplotlib.pyplot as plt

    out = Path(out)
    steps = [r for r in training(read_records(out)) if "moe_load" in r]
    if not steps:
        return None
    fig, (curves, even, last) = plt.subplots(1, 3, figsize=(13, 3.8))
    x = [r["step"] for r in steps]
    curves.plot(x, [r["moe_aux"] for r in steps], label="balancing loss")
    curves.plot(x, [r["moe_entropy"] for r in steps], label="router entropy (nats)")
    curves.set_xlabel("step")
    curves.legend()
    even.plot(x, [r["moe_imbalance"] for r in steps])
    even.set_xlabel("step")
    even.set_ylabel("busiest expert ÷ mean (worst layer)")
    load = steps[-1]["moe_load"]
    image = last.imshow(load, aspect="auto", cmap="viridis")
    last.set_xlabel("expert")
    last.set_ylabel("layer")
    last.set_title(f"step {x[-1]}: share of the choices")
    last.set_xticks(range(len(load[0])))
    last.set_yticks(range(len(load)))
    fig.colorbar(image, ax=last)
    for ax in (curves, even):
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{out.name}: mixture of experts")
    fig.tight_layout()
    return _save(fig, out / "experts.png")
