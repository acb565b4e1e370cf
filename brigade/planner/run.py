"""`brigade plan`: measure the model here and scale to the target (or cost it from its shapes,
`planner.formula`, when it is too large to run here), predict every layout, rank them.

The rows are ranked by step time, those that fit first; `--write-config` writes the best that
fits as a train config (`to_config`), the way `brigade tune` writes its choice.
"""

from __future__ import annotations

import math

import torch

from brigade.config import ModelConfig, RunConfig
from brigade.errors import BrigadeError
from brigade.parallel import chunked
from brigade.pipeline.batches.sample import tokens_per_sample
from brigade.pipeline.plans.action import PlanError
from brigade.pipeline.plans.schedule import SCHEDULES
from brigade.planner import cluster as clusters
from brigade.planner.attention import AttentionFacts, observe
from brigade.planner.config import PlanConfig
from brigade.planner.context import RING, check_cp, method
from brigade.planner.costs import FORMULA, MEASURED, measure
from brigade.planner.devices import cpu, host_memory
from brigade.planner.formula import from_shapes
from brigade.planner.mixture import mixture
from brigade.planner.predict import predict
from brigade.planner.scaling import scaled
from brigade.planner.space import Layout, enumerate_layouts
from brigade.planner.split_costs import TP
from brigade.planner.tensor import TensorFacts, facts
from brigade.train.memory import quiet_stderr


def model_config(cfg: PlanConfig, base: ModelConfig | None = None) -> ModelConfig:
    """The train config's model section for this plan (a GPT's context is the sequence length)."""
    m = ModelConfig(**vars(base)) if base else ModelConfig()
    m.model, m.context = cfg.model, cfg.seq_len
    return m


def load_spec(cfg: PlanConfig, m: ModelConfig):
    """The model as `brigade train` builds it (a GPT sized to the default text's vocabulary). An
    `hf:DIR` directory needs its weights only when built with memory (measured costs): on the
    meta device its config.json is enough."""
    from brigade.data.chars import load_text_data
    from brigade.train.data import from_config

    if cfg.model == "gpt":
        vocab, _, _ = load_text_data("", cfg.seq_len, 0.1)
        return from_config(m, 0, vocab_size=len(vocab))
    if cfg.model.startswith("hf:"):  # the token ids alone, at the planned sequence length
        return from_config(m, 0, block_size=cfg.seq_len, standalone=True, weights=False)
    return from_config(m, 0)


def target(cfg: PlanConfig) -> clusters.Cluster:
    if cfg.cluster:
        return clusters.load(cfg.cluster)
    return clusters.from_flags(cfg.nodes, cfg.gpus_per_node, cfg.device, cfg.reprobe)


def _names(text: str, flag: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def layouts(cfg: PlanConfig, world: int, n_blocks: int, tensor: TensorFacts | None = None,
            per_node: int = 0, experts: tuple[int, ...] = (), attention: AttentionFacts | None = None,
            cp_method: str = "all-to-all") -> list[Layout]:
    """The space asked for: every valid layout, narrowed by --dp, --pp, --shard, --cp, --tp, --ep,
    --schedules, ... `tensor`: what tp does to the model (None: no tp); tp degrees divide `per_node`
    (0: any); `experts`: every MoE layer's expert count (none: a dense model); `attention`: its
    attention calls (None: none, cp 1 alone), exchanged by `cp_method` (`context.method`).

    Raises:
        BrigadeError: a --dp/--pp/--shard/--cp/--tp/--ep that cannot divide the world or the model,
            or no layout left.
    """
    from brigade.config.recompute import MODES
    from brigade.pipeline.plans.schedule import check as check_schedule

    modes = _names(cfg.recompute, "--recompute")
    for mode in modes:
        if mode not in MODES:
            raise BrigadeError(f"--recompute {mode!r}: unknown mode: expected {', '.join(MODES)}")
    schedules = [check_schedule(s, "--schedules") for s in _names(cfg.schedules, "--schedules")]
    try:
        ms = [int(x) for x in _names(cfg.microbatches, "--microbatches")]
    except ValueError:
        raise BrigadeError(f"--microbatches {cfg.microbatches!r}: expected counts like 1,2,4") from None
    _fixed(cfg, world, n_blocks)
    _fixed_ep(cfg, world, experts)
    sizes = _tp_sizes(cfg, tensor, per_node)
    check_cp(cfg.cp, world, attention, cfg.seq_len, cp_method, cfg.model, cfg.tp, cfg.ep)
    ring, tried = cp_method == RING, (cfg.cp,) if cfg.cp > 1 else ()
    contexts = {tp: attention.cp_sizes(world // tp, tp, cfg.seq_len, ring, tried, per_node // tp)
                for tp in sizes if world % tp == 0} if attention is not None else None
    rows = [
        lay
        for lay in enumerate_layouts(world, n_blocks, cfg.batch_size, modes, schedules or None, ms or None,
                                     sizes, per_node, experts, contexts)
        if (not cfg.dp or lay.dp == cfg.dp)
        and (not cfg.pp or lay.pp == cfg.pp)
        and (not cfg.shard or lay.shard == cfg.shard)
        and (not cfg.cp or lay.cp == cfg.cp)
        and (not cfg.tp or lay.tp == cfg.tp)
        and (not cfg.ep or lay.ep == cfg.ep)
    ]
    if not rows:
        raise BrigadeError(
            f"no layout of {world} ranks divides batch {cfg.batch_size} and the model's "
            f"{n_blocks} blocks as asked: change --batch-size, --microbatches or --dp/--pp"
        )
    return rows


def _tp_sizes(cfg: PlanConfig, tensor: TensorFacts | None, per_node: int) -> tuple[int, ...]:
    """The tp degrees to consider: the model's (`planner.tensor`); a --tp it cannot take, one line."""
    sizes = tensor.sizes if tensor is not None else (1,)
    if cfg.tp > 1 and cfg.tp not in sizes:
        allowed = ", ".join(map(str, sizes[1:])) or "none: a block has no tp_plan"
        raise BrigadeError(f"--tp {cfg.tp}: the model's tensor-parallel plans allow {allowed}; give one "
                           "of them, or --tp 1")
    if cfg.tp > 1 and per_node and per_node % cfg.tp:
        raise BrigadeError(f"--tp {cfg.tp} does not divide a node's {per_node} devices: tensor parallel "
                           f"stays inside a node; give a divisor of {per_node}")
    return sizes


def _fixed(cfg: PlanConfig, world: int, n_blocks: int) -> None:
    """Refuse a --dp, --pp or --shard that cannot divide the world or the model, one line each."""
    for flag, v in (("--dp", cfg.dp), ("--pp", cfg.pp)):
        if v and world % v:
            raise BrigadeError(
                f"{flag} {v} does not divide the cluster's {world} ranks: give a divisor of {world}"
            )
    given = [(f, v) for f, v in (("--dp", cfg.dp), ("--pp", cfg.pp), ("--cp", cfg.cp), ("--tp", cfg.tp)) if v]
    product = math.prod(v for _, v in given)
    if cfg.dp and cfg.pp and (world % product or len(given) == 4 and product != world):
        raise BrigadeError(
            f"{' × '.join(f'{f} {v}' for f, v in given)} = {product}, but the cluster has {world} "
            "ranks: dp × pp × cp × tp must be the world"
        )
    if cfg.pp > n_blocks:
        raise BrigadeError(
            f"--pp {cfg.pp}: the model has {n_blocks} blocks, fewer than the stages: give --pp ≤ {n_blocks}"
        )
    dp = cfg.dp or (world // (cfg.pp * (cfg.cp or 1) * (cfg.tp or 1)) if cfg.pp else 0)
    if cfg.shard and dp and dp % cfg.shard:
        raise BrigadeError(f"--shard {cfg.shard} does not divide dp {dp}: give a divisor of it")


def _fixed_ep(cfg: PlanConfig, world: int, experts: tuple[int, ...]) -> None:
    """Refuse an --ep the model's experts or the data-parallel ranks cannot take, one line each."""
    ep = cfg.ep
    if ep < 0:
        raise BrigadeError(f"--ep {ep}: must be ≥ 0 (0: every degree the experts and dp allow)")
    if ep <= 1:
        return
    if not experts:
        raise BrigadeError(f"--ep {ep} but {cfg.model} has no mixture-of-experts layer to split: give a "
                           "model with experts (gpt with --experts, an MoE hf: directory), or drop --ep")
    bad = sorted({n for n in experts if n % ep})
    if bad:
        raise BrigadeError(f"--ep {ep} does not divide the {bad[0]} experts of an MoE layer: give a "
                           f"divisor of {bad[0]} (each process of an expert group holds experts ÷ ep)")
    dp = cfg.dp or (world // cfg.pp if cfg.pp else world)
    if dp % ep:
        raise BrigadeError(f"--ep {ep} does not divide the data-parallel ranks ({dp}): expert groups are "
                           f"carved out of dp; give a divisor of {dp}")


def sizes(rows: list[Layout], batch: int) -> list[int]:
    """Micro-batch sizes to measure at: the smallest, the largest and one between (interpolated)."""
    got = sorted({math.ceil(batch / (r.dp * r.microbatches)) for r in rows})
    return sorted({got[0], got[len(got) // 2], got[-1]})


def source(asked: str, shape) -> str:
    """measured or formula: `asked`, or for auto formula when training the model here (parameters,
    gradients and AdamW's two moments) would take more than half this machine's memory, or when
    it has no weights to measure with (a Hugging Face directory with config.json alone).

    Raises:
        BrigadeError: an unknown source; measured costs of a directory without weights.
    """
    if asked not in ("auto", MEASURED, FORMULA):
        raise BrigadeError(f"--costs {asked!r}: expected auto, measured or formula")
    weightless = shape.hf is not None and shape.hf.checkpoint is None
    if asked == MEASURED and weightless:
        raise BrigadeError(f"--costs measured: {shape.hf.directory} has config.json but no weights to "
                           "measure with: plan it with --costs formula (or auto), or add its safetensors")
    if asked != "auto":
        return asked
    states = 16 * sum(p.numel() for b in shape.blocks for p in b.parameters())  # fp32 master, as trained
    return FORMULA if weightless or states > host_memory() / 2 else MEASURED


def loss_chunk(cfg: PlanConfig, shape) -> int:
    """The positions of each sequence a chunk of the head's loss takes in the runs planned, 0 where
    they do not chunk it: as training decides (`parallel.chunked`), a position-wise head, not
    --chunked-loss off, a sequence longer than a chunk, and under auto a sequence's logits of at
    least `chunked.THRESHOLD` elements (a micro-batch of one sequence: larger ones chunk too).
    Schedules that split the backward do not chunk in training, nor do their plans (`predict`).
    Under cp a rank chunks its own part of each sequence, as training does, while the chunk's
    buffers are counted per sample and shared over cp like every activation: 1/cp of what a rank
    holds (a known gap, small beside the activations at the lengths cp is for).

    Raises:
        BrigadeError: --loss-chunk below 1.
    """
    if cfg.loss_chunk < 1:
        raise BrigadeError(f"--loss-chunk {cfg.loss_chunk}: a chunk takes at least 1 position; give "
                           "a positive number, like training's default 1024")
    head, positions = shape.blocks[-1], tokens_per_sample(shape)
    if not chunked.wanted(head, cfg.chunked_loss) or positions <= cfg.loss_chunk:
        return 0
    if cfg.chunked_loss == "auto" and not chunked.helps(1, positions, chunked.vocab(head)):
        return 0
    return cfg.loss_chunk


def plan(cfg: PlanConfig, base: ModelConfig | None = None) -> dict:
    """Every layout's prediction, ranked (module docstring), and what they were made from."""
    where = target(cfg)
    where.device.peak(cfg.precision)  # no known peak: refused before measuring anything
    m = model_config(cfg, base)
    with torch.device("meta"):  # shapes only: a model of any size costs nothing to build
        shape = load_spec(cfg, m)
    tensor = facts(shape.blocks)
    moe = mixture(shape.blocks, tokens_per_sample(shape))
    how, seen = method(cfg.cp_method, where.device), observe(shape)  # what --cp would exchange
    rows = layouts(cfg, where.world, len(shape.blocks), tensor, where.per_node, moe.counts if moe else (),
                   seen, how)
    modes = sorted({r.recompute for r in rows})
    at = sizes(rows, cfg.batch_size)
    with quiet_stderr():
        if source(cfg.costs, shape) == FORMULA:
            chunk = loss_chunk(cfg, shape)
            costs = from_shapes(shape, min(at), modes, where.device, cfg.precision, compile=cfg.compile,
                                float8=cfg.float8, loss_chunk=chunk)
            if chunk:  # what a layout whose plan splits the backward holds: its loss whole
                costs.unchunked = from_shapes(shape, min(at), modes, where.device, cfg.precision,
                                              compile=cfg.compile, float8=cfg.float8)
        else:
            timed_in = cfg.precision if where.device.measured else ""  # this machine: its own bf16
            here_tp = where.device.measured and any(r.tp == TP for r in rows)  # on one tp process
            here_shard = where.device.measured and any(r.shard > 1 for r in rows)  # FSDP2's own work
            costs = scaled(measure(load_spec(cfg, m), at, modes, cpu(), timed_in, tp=here_tp,
                                   shard=here_shard, compile=cfg.compile), where.device, cfg.precision)
    for each in (costs, costs.unchunked):
        if each is not None:
            each.tensor, each.attention = tensor, seen
    out, left = _predict_all(cfg, costs, where, rows, tokens_per_sample(shape))
    return {
        "model": cfg.model,
        "cluster": where.describe(),
        "nodes": where.nodes,
        "per_node": where.per_node,
        "device": vars(where.device),
        "batch_size": cfg.batch_size,
        "seq_len": cfg.seq_len,
        "cp_method": how,
        "source": costs.source,
        "rows": out,
        "left_out": left,
        # the model planned: the train config's model section, or a directory's own config.json
        "model_config": vars(m) if shape.hf is None else {"model": m.model, **shape.hf.config.to_dict()},
        # a mixture of experts: its parameters in all and those a token runs through (`planner.mixture`)
        **({"parameters": moe.describe()} if moe else {}),
    }


COSTED_SHAPES = 16  # a costed schedule (auto) is predicted on the shapes of this many best rows


def _predict_all(cfg: PlanConfig, costs, where, rows: list[Layout],
                 tokens: int) -> tuple[list[dict], list[dict]]:
    """Every layout's prediction, ranked, and the layouts left out with why.

    A costed schedule's search takes seconds per layout at pp 16, so it is predicted only in the
    shapes (data parallel, pp, V, m, recompute) of the best `COSTED_SHAPES` rows of the others:
    where it could rank first. Without other schedules in the space, in every shape. `tokens`:
    per sample (`sample.tokens_per_sample`), what tokens/s counts.
    """
    out, left = [], []

    def run(lays: list[Layout]) -> None:
        for lay in lays:
            try:
                out.append(predict(costs, lay, where, cfg.batch_size, tokens, cfg.precision,
                                   cp_method=cfg.cp_method))
            except PlanError as exc:
                left.append({"label": lay.label(), "reason": str(exc)})

    costed = [r for r in rows if SCHEDULES[r.schedule].costed and r.pp > 1]
    run([r for r in rows if r not in costed])
    out.sort(key=lambda r: (not r["fits"], r["step_s"]))
    best = {_shape(Layout(**{k: v for k, v in r["layout"].items() if k != "dp"}))
            for r in out[:COSTED_SHAPES]}
    run([r for r in costed if not out or _shape(r) in best])
    out.sort(key=lambda r: (not r["fits"], r["step_s"]))
    return out, left


def _shape(lay: Layout) -> tuple:
    return (lay.replicate, lay.shard, lay.pp, lay.virtual, lay.microbatches, lay.recompute, lay.tp, lay.ep,
            lay.cp)


def to_config(cfg: PlanConfig, row: dict, m: ModelConfig, nodes: int, per_node: int) -> RunConfig:
    """The train config of one row (`brigade train --config` reads it)."""
    run = RunConfig(model=m)
    run.data.block_size = cfg.seq_len
    lay = row["layout"]
    p = run.parallel
    p.nproc, p.nnodes, p.dp, p.pp, p.shard = per_node, nodes, lay["dp"], lay["pp"], lay["shard"]
    p.schedule, p.virtual, p.microbatches = lay["schedule"], lay["virtual"], lay["microbatches"]
    p.recompute, p.tp, p.compile = lay["recompute"], lay.get("tp", 1), cfg.compile
    p.ep, p.cp, p.cp_method = lay.get("ep", 1), lay.get("cp", 1), cfg.cp_method
    if lay["pp"] > 1:
        p.balance = ",".join(map(str, row["balance"]))
    run.train.batch_size = cfg.batch_size
    return run
