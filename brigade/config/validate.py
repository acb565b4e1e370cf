"""Checks of a run configuration that need no model, data, processes or world."""

from __future__ import annotations

from brigade.config.recompute import MODES
from brigade.config.sections import RunConfig
from brigade.errors import BrigadeError
from brigade.host.net import parse_endpoint


def logs(text: str) -> tuple[str, ...]:
    """--log's trackers, in order, each once.

    Raises:
        BrigadeError: a name that is not a tracker's.
    """
    from brigade.config.fielddoc import LOGS

    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    known = list(LOGS.names())
    for name in names:
        if name not in known:
            raise BrigadeError(f"--log {text}: {name!r} is not a tracker: expected {', '.join(known)}, "
                               "comma-separated (--log wandb,mlflow)")
    return names


def _positive(name: str, value: float, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        raise BrigadeError(f"--{name.replace('_', '-')} {value}: must be {'≥ 0' if zero_ok else '≥ 1'}")


def chunked_loss(mode: str) -> None:
    """--chunked-loss names one of `config.loss.MODES` (`brigade check` asks this too)."""
    from brigade.config.loss import MODES

    if mode not in MODES:
        raise BrigadeError(f"--chunked-loss {mode!r}: expected one of {', '.join(MODES)}")


def validate(cfg: RunConfig) -> None:
    """Checks that need no model, data, processes or world (see `resolve_layout`); changes nothing.

    Raises:
        BrigadeError: naming the value, what was expected, and how to fix it.
    """
    m, d, p, o, t = cfg.model, cfg.data, cfg.parallel, cfg.optim, cfg.train
    for name in ("n_layer", "n_head", "n_embd", "context"):
        _positive(name, getattr(m, name))
    for name in ("nproc", "pp", "local_stages", "microbatches", "threads", "grad_accum", "hang_timeout",
                 "loss_chunk"):
        _positive(name, getattr(p, name) if hasattr(p, name) else getattr(o, name))
    for name in ("max_steps", "batch_size", "eval_every", "eval_batches", "keep"):
        _positive(name, getattr(t, name))
    _positive("block_size", d.block_size)
    for name, value in (("dp", p.dp), ("virtual", p.virtual), ("max_restarts", p.max_restarts), ("lr", o.lr),
                        ("warmup_steps", o.warmup_steps), ("grad_clip", o.grad_clip),
                        ("snapshot_every", t.snapshot_every), ("sample_tokens", t.sample_tokens),
                        ("peak_tflops", t.peak_tflops)):
        _positive(name, value, zero_ok=True)
    chunked_loss(p.chunked_loss)
    if not 0 <= m.dropout < 1:
        raise BrigadeError(f"--dropout {m.dropout}: must be in [0, 1)")
    if not 0 < d.val_fraction < 1:
        raise BrigadeError(f"--val-fraction {d.val_fraction}: must be between 0 and 1")
    if d.block_size > m.context and not m.model.startswith("hf:"):  # hf: its config's positions
        raise BrigadeError(
            f"--block-size {d.block_size} is larger than the model's context {m.context}: "
            f"use --block-size ≤ {m.context} or raise --context"
        )
    if m.n_embd % m.n_head:
        raise BrigadeError(f"--n-embd {m.n_embd} is not a multiple of --n-head {m.n_head}")
    experts(m.experts, m.top_k, m.model)
    expert_parallel(p.ep, m.experts, m.model, p.local_stages)
    _context_parallel(cfg)
    from brigade.pipeline.plans import schedule  # the registry owns the names and each one's V
    sched = schedule.SCHEDULES[schedule.check(p.schedule)]
    v = sched.resolve_virtual(p.virtual)
    _auto_limit(p.auto_limit, sched, v)
    from brigade.config.precision import autocast_dtype  # owns the names; raises on an unknown one
    autocast_dtype(t.precision, t.bf16, "cpu")
    _speed_levers(cfg)
    _schedule_and_logs(o, t)
    _snapshots(t)
    _nodes(p)
    _positive("shard", p.shard)
    _tensor_parallel(p)
    if p.recompute not in MODES:
        raise BrigadeError(f"--recompute {p.recompute!r}: expected one of {', '.join(MODES)}")
    if p.shard > 1 and p.local_stages > 1:
        raise BrigadeError(f"--shard {p.shard} with --local-stages {p.local_stages}: FSDP2 shards over a "
                           "DeviceMesh of one device per process, and local stages drive several from "
                           "one; shard across processes (--pp) instead, or drop --shard")
    if p.shard > 1:
        _fsdp_available(p.shard)
    if p.pp > 1 and p.local_stages > 1:
        raise BrigadeError("--pp > 1 with --local-stages > 1 is not supported: use one or the other")


def _nodes(p) -> None:
    """--nnodes, --node-rank and, for several nodes, the rendezvous endpoint."""
    _positive("nnodes", p.nnodes)
    if not 0 <= p.node_rank < p.nnodes:
        raise BrigadeError(f"--node-rank {p.node_rank}: must be between 0 and --nnodes - 1 ({p.nnodes - 1})")
    if p.nnodes > 1 and (p.rdzv_endpoint or not p.min_nodes):  # elastic under torchrun: none needed
        parse_endpoint(p.rdzv_endpoint)


def _snapshots(t) -> None:
    """--snapshot-minutes and --stop-grace: spans of time, above 0 (NaN is none); the error policy."""
    if t.on_snapshot_error not in ("stop", "warn"):
        raise BrigadeError(f"--on-snapshot-error {t.on_snapshot_error!r}: expected stop (end the run) or "
                           "warn (say so and train on)")
    if not t.snapshot_minutes > 0:
        raise BrigadeError(f"--snapshot-minutes {t.snapshot_minutes:g}: must be above 0, the minutes "
                           "between snapshots; leave it out to snapshot by --snapshot-every's steps only")
    if not t.stop_grace > 0:
        raise BrigadeError(f"--stop-grace {t.stop_grace:g}: must be above 0, the seconds a stop signal "
                           "leaves before the kill that follows it")


def experts(n: int, top_k: int, model: str) -> None:
    """--experts and --top-k: none, or the built-in GPT's, top-k from 1 to the experts (train, check)."""
    _positive("experts", n, zero_ok=True)
    if n and model != "gpt":
        raise BrigadeError(f"--experts {n} with --model {model}: --experts builds the built-in gpt's "
                           "mixture of experts; drop it, or use --model gpt")
    if n and not 1 <= top_k <= n:
        raise BrigadeError(f"--top-k {top_k} with --experts {n}: each token goes to from 1 to {n} experts; "
                           f"give a --top-k in that range")


def expert_parallel(ep: int, experts: int, model: str, local_stages: int = 1) -> None:
    """--ep: a positive degree, across processes, over a model with experts that it divides (the
    built-in gpt's --experts; an hf: model's are checked once its config is read, and that ep
    divides dp with the world)."""
    _positive("ep", ep)
    if ep == 1:
        return
    if local_stages > 1:
        raise BrigadeError(f"--ep {ep} with --local-stages {local_stages}: expert parallel splits experts "
                           "over processes, and local stages drive several devices from one; pipeline "
                           "across processes (--pp) instead, or drop --ep")
    if model == "gpt" and not experts:
        raise BrigadeError(f"--ep {ep} but the gpt has no experts to split: give --experts (a multiple of "
                           f"{ep}), or drop --ep")
    if experts % ep:
        raise BrigadeError(f"--ep {ep} does not divide --experts {experts}: give --ep a divisor of {experts} "
                           "(each process of an expert group holds experts ÷ ep of them)")


def _context_parallel(cfg: RunConfig) -> None:
    """--cp: a positive degree over processes (`config.context.check_layout`), a --block-size it
    splits, and, for the built-in gpt under all-to-all, heads it splits; not under an elastic
    node range, nor with an hf:DIR model's document masks."""
    from brigade.config import context  # owns the rules

    p, m = cfg.parallel, cfg.model
    _positive("cp", p.cp)
    context.check_layout(p.cp, p.cp_method, local_stages=p.local_stages, ep=p.ep)
    if p.cp == 1:
        return
    if p.min_nodes:
        raise BrigadeError(f"--cp {p.cp} with an elastic --nnodes {p.min_nodes}:{p.nnodes}: not supported "
                           "yet (the node counts an elastic run reaches are checked against pp only); give "
                           "a fixed --nnodes, or drop --cp")
    context.check_length(cfg.data.block_size, p.cp, p.tp if p.sequence_parallel else 1,
                         "ring" if p.cp_method == "ring" else "all-to-all")
    if m.model.startswith("hf:") and cfg.data.document_mask:
        context.refuse_documents(p.cp)
    if m.model == "gpt" and p.cp_method != "ring":
        context.check_heads(m.n_head, m.n_head, p.cp, p.tp, where="the gpt (--n-head)")


def _tensor_parallel(p) -> None:
    """--tp: a positive degree, over processes, not under an elastic node range."""
    _positive("tp", p.tp)
    if p.tp > 1 and p.local_stages > 1:
        raise BrigadeError(f"--tp {p.tp} with --local-stages {p.local_stages}: tensor parallel splits each "
                           "block over processes of a DeviceMesh, and local stages drive several devices "
                           "from one process; pipeline across processes (--pp) instead, or drop --tp")
    if p.tp > 1 and p.min_nodes:
        raise BrigadeError(f"--tp {p.tp} with an elastic --nnodes {p.min_nodes}:{p.nnodes}: not supported "
                           "yet (the node counts an elastic run reaches are checked against pp only); give a "
                           "fixed --nnodes, or drop --tp")


def _schedule_and_logs(o, t) -> None:
    """The learning rate's schedule (`config.lr` owns the names) and --log's trackers."""
    from brigade.config.lr import check as check_lr

    check_lr(o.lr_schedule, o.decay_steps, o.decay_fraction)
    logs(t.log)


def _speed_levers(cfg: RunConfig) -> None:
    """--float8's recipe and --adamw's update, by the names their owners give."""
    if cfg.parallel.float8:
        from brigade.config.precision import check_float8  # owns the recipes
        check_float8(cfg.parallel.float8)
    from brigade.config.optimizer import UPDATES
    if cfg.optim.adamw not in UPDATES:
        raise BrigadeError(f"--adamw {cfg.optim.adamw!r}: expected one of {', '.join(UPDATES)}")


def _auto_limit(limit: int, sched, v: int) -> None:
    """--auto-limit: for a costed schedule only, and room for one micro-batch in each stage of a rank."""
    if limit == 0:
        return
    if not sched.costed:
        raise BrigadeError(f"--auto-limit {limit}: only a generated schedule (--schedule auto) takes a "
                           f"memory limit; {sched.name}'s is fixed by its plan: drop --auto-limit")
    if limit < v:
        raise BrigadeError(f"--auto-limit {limit}: below the {v} stages each pipeline rank holds (--virtual "
                           f"{v}); allow at least {v}, or 0 for no limit")


def _fsdp_available(shard: int) -> None:
    """FSDP2's `fully_shard` lives in torch.distributed.fsdp from torch 2.6 on."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        import torch

        raise BrigadeError(f"--shard {shard} needs FSDP2 (torch.distributed.fsdp.fully_shard, torch ≥ 2.6) "
                           f"but this torch is {torch.__version__}: upgrade torch, or drop --shard") from None
