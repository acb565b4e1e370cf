"""Experiment trackers beside metrics.jsonl: Weights & Biases and MLflow (`--log wandb,mlflow`),
fed the same records as every other sink (`metrics.Sink`), on rank 0.

    --log wandb    `wandb.init` with project $WANDB_PROJECT (else "brigade"), the run folder's name,
                   its files under OUT/wandb, and OUT/config.toml as the run's config. The run's
                   id is kept in OUT/wandb-run-id, so a restart by the agent or a resume by the
                   user goes on in the same W&B run. WANDB_MODE=offline writes it all locally
                   (`wandb sync OUT/wandb/offline-run-*` uploads it later), as the tests run it.
    --log mlflow   to $MLFLOW_TRACKING_URI where set (a server, a database), else a file store in
                   OUT/mlruns; experiment $MLFLOW_EXPERIMENT_NAME (else "brigade"); the run's id
                   kept in OUT/mlflow-run-id likewise, config.toml's keys as its parameters
                   (`section.key`). `MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri OUT/mlruns`
                   shows a file store (MLflow 3 asks the variable of a file store's readers).

Each number of a record goes under the tag every sink gives it (`scalars`, TensorBoard's too):
`train/loss`, `train/mfu`, `val/loss`, `event/snapshot/seconds`... A resumed run logs again from
its snapshot's step: W&B keeps the first value of a step (its steps only grow, and it says so
once), MLflow keeps both; metrics.jsonl (trimmed to the snapshot) is the run's own record.

Install with `pip install 'brigade[wandb]'` or `'brigade[mlflow]'` (mlflow-skinny: the tracking
client alone); a missing package is refused before the run starts (`require`).
"""

from __future__ import annotations

import math
import os
import uuid
from pathlib import Path

from brigade.errors import BrigadeError

_NOT_SCALARS = ("step", "time", "event", "samples")


def scalars(record: dict) -> list[tuple[str, float]]:
    """A record's numbers under the tags every tracker gives them: `train/<key>` for a training
    step, `val/loss`, and `event/<name>/<key>` for an event."""
    event = record.get("event")
    prefix = f"event/{event}" if event is not None else "val" if "val_loss" in record else "train"
    return [("val/loss" if key == "val_loss" else f"{prefix}/{key}", value) for key, value in record.items()
            if key not in _NOT_SCALARS and _is_number(value)]


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


TRACKERS = {"wandb": ("wandb", "brigade[wandb]"), "mlflow": ("mlflow", "brigade[mlflow]")}
WANDB_ID, MLFLOW_ID, MLFLOW_DIR = "wandb-run-id", "mlflow-run-id", "mlruns"


def require(names: tuple[str, ...]) -> None:
    """Check, before any work, that each tracker's package imports.

    Raises:
        BrigadeError: one line naming the package and the pip command that installs it.
    """
    for name in names:
        if name not in TRACKERS:
            continue
        module, extra = TRACKERS[name]
        try:
            __import__(module)
        except ImportError:
            raise BrigadeError(f"--log {name} needs the {module} package: pip install '{extra}'") from None


def _config(out: Path) -> dict:
    """OUT/config.toml as the run wrote it (an empty dict where it has none: a run started from
    Python without the launcher)."""
    from brigade.config import load_toml

    path = out / "config.toml"
    return load_toml(path) if path.is_file() else {}


def _kept_id(path: Path, make) -> str:
    """The id kept in `path`, or a new one from `make()`, kept there."""
    if path.is_file():
        return path.read_text().strip()
    made = make()
    path.write_text(made + "\n")
    return made


class _Tracker:
    """A tracker's sink: each record's numbers (`scalars`), where it has any, to `_log`."""

    def write(self, record: dict) -> None:
        values = dict(scalars(record))
        if values:
            self._log(values, record["step"])

    def _log(self, values: dict, step: int) -> None:
        raise NotImplementedError


class WandbSink(_Tracker):
    """The records as a W&B run's history (module docstring)."""

    def __init__(self, out: Path):
        import wandb

        run_id = _kept_id(out / WANDB_ID, lambda: uuid.uuid4().hex[:12])  # a W&B id: letters, digits
        (out / "wandb").mkdir(exist_ok=True)
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "brigade"), name=out.resolve().name,
                               id=run_id, resume="allow", dir=str(out), config=_config(out))

    def _log(self, values: dict, step: int) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


class MLflowSink(_Tracker):
    """The records as an MLflow run's metrics (module docstring)."""

    def __init__(self, out: Path):
        import mlflow

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the file store is what we chose
            mlflow.set_tracking_uri((out / MLFLOW_DIR).resolve().as_uri())
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "brigade"))
        kept = out / MLFLOW_ID
        resumed = kept.read_text().strip() if kept.is_file() else None
        self._mlflow = mlflow
        self._run = mlflow.start_run(run_id=resumed, run_name=None if resumed else out.resolve().name)
        if resumed is None:
            kept.write_text(self._run.info.run_id + "\n")
            params = {f"{s}.{k}": v for s, keys in _config(out).items() for k, v in keys.items()}
            mlflow.log_params({k: str(v)[:500] for k, v in params.items()})

    def _log(self, values: dict, step: int) -> None:
        self._mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


SINKS = {"wandb": WandbSink, "mlflow": MLflowSink}
