"""Whether a snapshot can resume a run: the configuration facts a manifest records, and the check.

A snapshot resumes a run whose model, data, optimizer, batch size and seed are the ones it was
trained with (`config.config_subset`, hashed by `config.config_hash`); the layout (dp, pp, local
stages, schedule and stages per rank) and the run's length may change: parameters are named by
their block's index in the whole model, whichever rank held it. A longer or shorter run keeps
its learning rate's decay where it ended unless told otherwise (`check_schedule`, `config.lr`).
"""

from __future__ import annotations

from brigade.config import RunConfig, config_hash, config_subset, pipeline_shape
from brigade.config.lr import decay_end
from brigade.snapshot.format import Manifest, SnapshotError

_DEFAULTS = config_subset(RunConfig())  # a key a snapshot lacks was written before it, at this
# ... unless the setting's default is not what runs did before it existed: packed windows
# attended across documents until --document-mask (on by default) came.
_BEFORE = {"data": {"document_mask": False}}


def run_facts(cfg: RunConfig, cursor: int, epoch: int, vocab: str | None,
              balance: list[int] | None = None, data: str | None = None) -> dict:
    """The run's part of a manifest (`writer.Writer.save` adds the step, checksums and hashes).

    Args:
        cursor, epoch: the data sampler's position.
        vocab: a GPT's characters; None for other models.
        balance: blocks per stage the run was cut into: where it measured its cut (auto without
            --balance), a resume cuts the same way, so its numbers go on exactly
            (`train.run.resumed_cut`).
        data: the token shard set's `content_sha256` (a tokenized model's data), so a resume
            can say when the data changed under it (`train.run.resume`).
    """
    p = cfg.parallel
    return {**({"balance": list(balance)} if balance else {}), **({"data": data} if data else {}),
            "lr_end": decay_end(cfg.optim.decay_steps, cfg.train.max_steps), "cursor": cursor, "epoch": epoch,
            "layout": {"dp": p.dp, "pp": p.pp, "local_stages": p.local_stages,
                       "virtual": pipeline_shape(p)[1], "tp": p.tp, "cp": p.cp},
            "config_hash": config_hash(cfg), "config": config_subset(cfg),
            "model": cfg.model.model, "vocab": vocab}


def check_compatible(manifest: Manifest, cfg: RunConfig) -> None:
    """Refuse a snapshot of another model or training configuration (the layout may differ).

    Raises:
        SnapshotError: naming what differs.
    """
    check_schedule(manifest, cfg)
    if manifest.config_hash == config_hash(cfg):
        return
    saved = manifest.config
    now = config_subset(cfg)
    changed = [f"{s}.{k}" for s in now for k in now[s]
               if saved.get(s, {}).get(k, _BEFORE.get(s, {}).get(k, _DEFAULTS[s].get(k))) != now[s][k]]
    if not changed:  # a snapshot written before a setting existed, the setting at its default
        return
    what = "another model" if any(c.startswith("model.") for c in changed) else "another configuration"
    raise SnapshotError(
        f"the snapshot in {cfg.train.out} is of {what} (differs in {', '.join(changed) or 'hash'}): "
        "use a new --out, or the settings it was trained with"
    )


def check_schedule(manifest: Manifest, cfg: RunConfig) -> None:
    """Refuse a resume that would move the step the learning rate's decay ends on when the user
    did not say where it goes: --decay-steps 0 and another --max-steps than the snapshot's end.

    Raises:
        SnapshotError: one line with both ways on (keep the end, or move it).
    """
    o, steps, end = cfg.optim, cfg.train.max_steps, manifest.lr_end
    if end is None or o.lr_schedule == "constant" or o.decay_steps or end == steps:
        return
    raise SnapshotError(
        f"--max-steps {steps}: the snapshot in {cfg.train.out} ends its {o.lr_schedule} decay on step {end} "
        f"(--max-steps then), and following --max-steps would reshape the decay from here on: add "
        f"--decay-steps {end} to keep it (the steps past {end} train at --min-lr), or --decay-steps "
        f"{steps} to stretch what is left of it to the new end"
    )
