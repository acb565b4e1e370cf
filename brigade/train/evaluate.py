"""`brigade eval --from RUN [--data PATH]`: a run's newest snapshot scored on held-out text, on any
layout: the mean loss a token, its perplexity (e to the loss) and the tokens counted.

The run's own configuration (RUN/config.toml) builds the model, as `brigade train` would resume
it; the layout is the command's (`--nproc`, `--pp`, `--tp`, ... : a snapshot loads under any
layout, `snapshot.collective`), so a model trained on eight GPUs scores on one. The text is
`--data` (held out as `--val-data` is: a text in the GPT's characters, or for an `hf:DIR` model a
corpus, tokenized into RUN/tokens-val, or a shard set), or, without it, the run's own
validation set (its `--val-data`, or --data's last --val-fraction).

The windows tile the text: block after block of --block-size, none overlapping (a GPT's text
windows start at every character when trained on; scored, each character is counted once),
`--batches` global batches of `--batch-size` of them in order (0: every whole batch the text
holds). Every batch's mean loss is the pipeline's, as a training run's validation loss is
(`Trainer.evaluate`), so on the run's own validation set and batches the two agree. One process
by default; under dp or micro-batches a batch's loss is the mean of its parts' means, which is the
mean a token only where every part counts as many targets (a chat corpus's masked prompts do
not: there the default, one process and one micro-batch, is the per-token mean).

Nothing in RUN is changed but its logs/ (the agent's log of this command) and, for an `hf:DIR`
model given a corpus, the tokenized cache RUN/tokens-val.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from brigade.config import RunConfig
from brigade.errors import BrigadeError


@dataclass(frozen=True)
class EvalConfig:
    """What `brigade eval` scores and how much of it."""

    source: str  # --from: the run folder
    data: str = ""  # a held-out text, corpus or shard set; "": the run's own validation set
    batches: int = 0  # global batches scored; 0: every whole batch the text holds


def run_config(ev: EvalConfig, layout: dict, batch_size: int | None) -> tuple[RunConfig, str]:
    """The run's configuration with this command's layout, data and batch size, and the run's own
    --val-data (what its snapshot is checked against: the text held out here is not the run's).

    Raises:
        BrigadeError: RUN is no run folder with a snapshot, or its config.toml does not load.
    """
    from brigade import config
    from brigade.snapshot.format import find_latest

    folder = Path(ev.source)
    if not (folder / "config.toml").is_file():
        raise BrigadeError(f"--from {ev.source!r} has no config.toml: give the --out folder of a "
                           "training run")
    found = find_latest(folder, warn=lambda m: print(f"brigade: warning: {m}", flush=True))
    if found is None:
        raise BrigadeError(f"--from {ev.source!r} has no snapshot to score: train it until it writes one "
                           "(--snapshot-every, or the end of the run)")
    toml = config.load_toml(folder / "config.toml")
    # the run's layout does not carry over: this command's (one process by default), resolved anew
    toml["parallel"] = {k: v for k, v in toml.get("parallel", {}).items() if k in ("backend", "threads")}
    own = toml.setdefault("data", {}).get("val_data", "")
    toml["data"].update({"val_data": ev.data} if ev.data else {})
    toml.setdefault("train", {}).update(out=str(folder), log="", tensorboard=False,
                                        **({"batch_size": batch_size} if batch_size else {}))
    # the run's length as its snapshot's decay ends (the schedule is not this command's concern)
    if found.manifest.lr_end:
        toml["train"]["max_steps"] = found.manifest.lr_end
    # one process where the command names no layout (a run's own default is train's, 2)
    return config.build(argparse.Namespace(**(layout or {"nproc": 1})), toml), own


def windows(data, batch_size: int, batches: int) -> list[torch.Tensor]:
    """The global batches of window indices that tile `data` (a text's or a shard set's
    windows) in order, `batches` of them (0: every whole one).

    Raises:
        BrigadeError: the text holds fewer windows than one batch.
    """
    stride = getattr(data, "block_size", 1) if getattr(data, "stride", None) == 1 else 1
    tiles = torch.arange(0, len(data), stride)
    whole = len(tiles) // batch_size
    if whole == 0:
        raise BrigadeError(f"the text holds {len(tiles)} windows, fewer than one batch of --batch-size "
                           f"{batch_size}: give more text or a smaller --batch-size")
    n = min(batches, whole) if batches else whole
    return list(tiles[: n * batch_size].view(n, batch_size))


def corpora(cfg: RunConfig, ev: EvalConfig, own_val_data: str, val) -> dict[str, tuple[float, object]]:
    """{corpus: (weight, its validation windows)} where the scored set mixes several (`data.mix`):
    `--data`'s mixture, else the run's --val-data's, else its --data's held-out parts; {} for one."""
    from brigade.data.mix import Mixture, parse

    if not isinstance(val, Mixture):
        return {}
    spec = ev.data or own_val_data or cfg.data.data
    return {path: (weight, part) for (path, weight), part in zip(parse(spec), val.parts)}


def mixed(got: dict[str, dict]) -> dict:
    """A mixture's figures from its corpora's: the loss their mean by weight (what the mixture
    trains on), tokens and batches their sums."""
    total = sum(g["weight"] for g in got.values())
    loss = sum(g["weight"] * g["loss"] for g in got.values()) / total
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": sum(g["tokens"] for g in got.values()),
            "batches": sum(g["batches"] for g in got.values())}


def worker(cfg: RunConfig, ev: EvalConfig, own_val_data: str) -> dict:
    """One process of `brigade eval`: the model built and loaded from the newest snapshot (checked
    against the run's configuration, its own --val-data), then every batch of `windows` scored;
    the figures on every rank."""
    import torch.distributed as dist

    from brigade import forensics
    from brigade.data.sampler import Sampler
    from brigade.launcher import groups
    from brigade.parallel import lora
    from brigade.train.data import build
    from brigade.train.run import resume
    from brigade.train.trainer import Trainer, _batch

    p = cfg.parallel
    info = groups.init(p.backend, p.threads, forensics.group_timeout(p.hang_timeout), p.local_stages)
    try:
        blocks, loss_fn, train, val, _, weights, _ = build(cfg, val_flag="--data")
        trainer = Trainer(blocks, loss_fn, train, val, parallel=p, optim=cfg.optim, train=cfg.train,
                          weights=weights, metrics=False, adapters=lora.spec_of(cfg.model, cfg.train.seed))
        step = resume(trainer, replace(cfg, data=replace(cfg.data, val_data=own_val_data)))
        trainer.model.eval()
        w = trainer.world

        def score(data) -> dict:
            losses, tokens = [], torch.zeros((), dtype=torch.int64, device=w.device)
            for batch in windows(data, cfg.train.batch_size, ev.batches):
                x, y = _batch(data, Sampler.shard(batch, w.coords.dp, w.degrees.dp))
                losses.append(float(trainer.engine.evaluate(x, y)))
                tokens += (y != -100).sum().to(w.device)  # this replica's counted targets
            if w.degrees.dp > 1:  # every replica's: a masked text counts unevenly
                dist.all_reduce(tokens, group=w.group("dp"))
            loss = sum(losses) / len(losses)
            return {"loss": loss, "perplexity": math.exp(loss), "tokens": int(tokens),
                    "batches": len(losses)}

        parts = corpora(cfg, ev, own_val_data, val)  # a mixture: each corpus on its own windows
        got = {path: {"weight": weight, **score(part)} for path, (weight, part) in parts.items()}
        whole = mixed(got) if got else score(val)
        trainer.close()
    finally:
        groups.destroy()
    return {"rank": info.rank, "step": step, **whole, "batch_size": cfg.train.batch_size,
            "block_size": cfg.data.block_size, **({"corpora": got} if got else {})}


# The layout flags `brigade eval` takes, as `brigade train` names them (their help is the fields').
LAYOUT = ("nproc", "dp", "pp", "tp", "cp", "ep", "shard", "local_stages", "schedule", "virtual",
          "microbatches", "threads", "backend")


def add_eval(sub, json_arg) -> None:
    """`brigade eval`'s flags."""
    from dataclasses import fields

    from brigade.config import ParallelConfig
    from brigade.config.fielddoc import flag_help

    p = sub.add_parser("eval", help="score a run's newest snapshot on held-out text: loss, perplexity, "
                                    "tokens (any layout)")
    p.add_argument("--from", dest="source", required=True, help="the run folder (train's --out)")
    p.add_argument("--data", default="", help="the held-out text (an hf:DIR model: a corpus or a shard "
                                              "set); default: the run's own validation set")
    p.add_argument("--batches", type=int, default=0,
                   help="global batches to score, in order; 0: every whole batch the text holds")
    p.add_argument("--batch-size", type=int, default=None,
                   help="windows a global batch holds (default: the run's --batch-size)")
    by_name = {f.name: f for f in fields(ParallelConfig)}
    group = p.add_argument_group("layout (as brigade train's; the snapshot loads under any)")
    for name in LAYOUT:
        f = by_name[name]
        kind = int if f.type in (int, "int") else str
        group.add_argument("--" + name.replace("_", "-"), type=kind, default=argparse.SUPPRESS,
                           metavar=kind.__name__.upper(), help=flag_help(f))
    json_arg(p)
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    """Score the run (module docstring); one line, or `--json` one object."""
    import json

    from brigade.train.supervise import launch_with_events

    if args.batches < 0:
        raise BrigadeError(f"--batches {args.batches}: must be ≥ 0 (0: every whole batch)")
    from brigade.train.data import build

    ev = EvalConfig(args.source, args.data, args.batches)
    cfg, own = run_config(ev, {k: getattr(args, k) for k in LAYOUT if hasattr(args, k)}, args.batch_size)
    built = build(cfg, val_flag="--data")  # the text checked (and a corpus tokenized) here, once
    for part in getattr(built.val, "parts", [built.val]):  # and that it (each corpus) holds a batch
        windows(part, cfg.train.batch_size, ev.batches)
    results = launch_with_events(worker, cfg, ev, own)
    got = {k: v for k, v in results[min(results)].items() if k != "rank"}
    got = {"from": args.source, "data": args.data or "the run's validation set", **got}
    if args.json:
        print(json.dumps(got))
        return 0
    mix = " (the corpora's losses by weight)" if "corpora" in got else ""
    print(f"brigade eval: {got['from']} at step {got['step']} on {got['data']}: loss {got['loss']:.4f}{mix}, "
          f"perplexity {got['perplexity']:.2f}, {got['tokens']} tokens ({got['batches']} batches of "
          f"{got['batch_size']} × {got['block_size']})", flush=True)
    for path, g in got.get("corpora", {}).items():
        print(f"  {path} (weight {g['weight']:g}): loss {g['loss']:.4f}, perplexity {g['perplexity']:.2f}, "
              f"{g['tokens']} tokens ({g['batches']} batches)", flush=True)
    return 0
