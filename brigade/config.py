"""Typed run configuration: one dataclass per component, composed into `RunConfig`.

Sources, later wins: the defaults here, a TOML file (`--config run.toml`, one
table per section), then command-line flags. Flags are generated from the
fields: `ParallelConfig.microbatches` is `--microbatches`, `TrainConfig.max_steps`
is `--max-steps`. Every field name is unique across sections, so flags stay flat.

    [parallel]
    nproc = 2
    pp = 2
    [train]
    max_steps = 500
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from collections.abc import Collection
from dataclasses import dataclass, field, fields
from pathlib import Path

from brigade import elastic
from brigade.errors import BrigadeError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass
class ModelConfig:
    model: str = "gpt"  # gpt, toy, mlp, resnet50, or path/to/file.py:factory
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    context: int = 128  # the model's longest sequence (positions it knows)
    dropout: float = 0.0


@dataclass
class DataConfig:
    data: str = ""  # a UTF-8 text file; empty: CPython's pydoc topics, on every machine
    block_size: int = 128  # training sequence length, at most the model's context
    val_fraction: float = 0.1


@dataclass
class ParallelConfig:
    nproc: int = 2  # processes on this node
    nnodes: int = 1  # machines (MAX of --nnodes MIN:MAX); each runs `brigade train` with its --node-rank
    min_nodes: int = 0  # elastic: fewest machines to train on (MIN of --nnodes MIN:MAX); 0: --nnodes
    node_rank: int = 0
    rdzv_endpoint: str = ""  # HOST:PORT of node 0's rendezvous, for --nnodes > 1
    local_addr: str = ""  # address this node advertises; empty: the one that routes to node 0
    dp: int = 0  # data-parallel replicas; 0: whatever nproc / pp leaves
    pp: int = 1  # pipeline stages, one process each
    local_stages: int = 1  # pipeline stages inside each process, one thread per device
    schedule: str = "1f1b"  # gpipe, 1f1b, zb
    microbatches: int = 4
    balance: str = ""  # blocks per stage like "3,3"; empty: balance parameters
    backend: str = "auto"  # auto, gloo, nccl
    threads: int = 1  # CPU threads per process
    max_restarts: int = 0
    hang_timeout: int = 120  # seconds a collective or transfer may wait before the run fails
    rdzv_timeout: int = 120  # seconds nodes wait for each other at a rendezvous (elastic: for MIN)
    rdzv_last_call: int = 10  # elastic: seconds a rendezvous waits for more nodes once MIN are there


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # 0 disables clipping
    grad_accum: int = 1  # optimizer step every N batches


@dataclass
class TrainConfig:
    max_steps: int = 1000
    batch_size: int = 32  # global batch, across data-parallel replicas
    seed: int = 0
    eval_every: int = 200
    eval_batches: int = 8
    out: str = "runs/latest"
    sample_tokens: int = 300
    snapshot_every: int = 100  # 0: only at the end
    keep: int = 2  # snapshots kept
    tensorboard: bool = False  # also write OUT/tensorboard event files (pip install 'brigade[tensorboard]')
    bf16: bool = True  # autocast to bf16 on GPUs (ignored on CPU)
    precision: str = ""  # bf16, fp16 (loss-scaled) or fp32 on any device; empty: follow --bf16


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in fields(RunConfig)}


def _section_classes() -> dict[str, type]:
    hints = typing.get_type_hints(RunConfig)
    return {name: hints[name] for name in SECTIONS}


def _field_types(cls: type) -> dict[str, type]:
    return {k: v for k, v in typing.get_type_hints(cls).items()}


def _coerce(value: object, kind: type, where: str) -> object:
    """Check a TOML value against the field's type (ints are accepted for floats)."""
    if isinstance(kind, types.UnionType):
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise BrigadeError(f"{where} = {value!r} is a {type(value).__name__}, expected {kind.__name__}: "
                           "fix it in the file")
    return value


def load_toml(path: str | Path) -> dict[str, dict]:
    """Read and check a TOML config: known sections and keys, right types.

    Raises:
        BrigadeError: missing or malformed file, unknown section or key, wrong type.
    """
    path = Path(path)
    if not path.is_file():
        raise BrigadeError(f"config file {str(path)!r} not found: give the path to a .toml file")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise BrigadeError(f"config file {path} is not valid TOML ({exc}): fix the syntax") from None
    classes = _section_classes()
    out: dict[str, dict] = {}
    for section, table in raw.items():
        if section not in classes or not isinstance(table, dict):
            raise BrigadeError(f"{path}: unknown section [{section}]: expected one of {', '.join(classes)}")
        kinds = _field_types(classes[section])
        for key, value in table.items():
            if key not in kinds:
                raise BrigadeError(f"{path}: unknown key {key!r} in [{section}]: expected one of "
                                   f"{', '.join(kinds)}")
            out.setdefault(section, {})[key] = _coerce(value, kinds[key], f"{path}: [{section}] {key}")
    return out


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per field, default SUPPRESS so only what the user typed overrides."""
    for section, cls in _section_classes().items():
        group = parser.add_argument_group(section)
        for f in fields(cls):
            kind = _field_types(cls)[f.name]
            flag = "--" + f.name.replace("_", "-")
            default = f.default
            if f.name == "nnodes":  # N, or MIN:MAX (parsed in `build`, so a mistake is one line)
                group.add_argument(flag, default=argparse.SUPPRESS, metavar="N|MIN:MAX", help=elastic.HELP)
            elif kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS, help=f"(default: {default})")
            else:
                group.add_argument(flag, type=kind, default=argparse.SUPPRESS, metavar=kind.__name__.upper(),
                                   help=f"(default: {default!r})")
    parser.add_argument("--config", default=None, help="a TOML file; flags override it")


def build(args: argparse.Namespace | None = None, toml: dict[str, dict] | None = None,
          world: World | None = None) -> RunConfig:
    """Defaults ← TOML ← flags, then `validate`, then `resolve_layout` for `world`.

    Args:
        args: parsed flags (only those the user typed are present).
        toml: a loaded config file; by default the one `--config` names.
        world: the processes a launcher started (torchrun, srun); None: brigade starts
            `--nproc` × `--nnodes` itself.

    Raises:
        BrigadeError: a value out of range, or a layout that contradicts the world.
    """
    cfg = RunConfig()
    given = vars(args) if args is not None else {}
    if toml is None and given.get("config"):
        toml = load_toml(given["config"])
    for section, values in (toml or {}).items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    given = elastic.split_nnodes(given)  # --nnodes N or MIN:MAX → nnodes, min_nodes
    for section in SECTIONS:
        part = getattr(cfg, section)
        for f in fields(part):
            if f.name in given:
                setattr(part, f.name, given[f.name])
    validate(cfg)
    typed = {k for k in given if given[k] is not None} | set((toml or {}).get("parallel", {}))
    return resolve_layout(cfg, world, given=typed)


@dataclass(frozen=True)
class World:
    """The processes of a run as a launcher started them.

    size: processes in all; local: on this node (None: the launcher does not say);
    launcher: who started them, for messages ("torchrun", "Slurm").
    """

    size: int
    local: int | None = None
    launcher: str = "the launcher"


def resolve_layout(cfg: RunConfig, world: World | None = None, given: Collection[str] = ()) -> RunConfig:
    """The one place the layout is derived: dp = world ÷ pp when --dp is 0. Pure.

    Local stages live inside one process, so they do not divide the world. Under a launcher
    the world is the launcher's; `--nproc` and `--nnodes` then only need to agree with it if
    the user gave them (`given`: field names typed or in the TOML file). An elastic range
    is checked at every node count it can reach (`elastic.check_range`).

    Returns:
        a copy of `cfg` with `dp` set and, under a launcher, `nproc` / `nnodes` the launcher's.

    Raises:
        BrigadeError: the world is not divisible by --pp, dp × pp ≠ world, a given --nproc or
            --nnodes that the launcher contradicts, or a batch that does not split over dp.
    """
    p = cfg.parallel
    nproc, nnodes, size = p.nproc, p.nnodes, p.nproc * p.nnodes
    where = f"--nproc {p.nproc} × --nnodes {p.nnodes}"
    if world is not None:
        (nproc, nnodes), size = _launcher_nodes(p, world, given), world.size
        where = f"set by {world.launcher}"
    dp = p.dp
    if dp == 0:
        if size % p.pp:
            raise BrigadeError(f"world size {size} ({where}) is not divisible by --pp {p.pp}: make it a "
                               "multiple of the pipeline stages")
        dp = size // p.pp
    if dp * p.pp != size:
        fix = "" if world is None else f", or leave --dp out to derive it ({size} ÷ --pp)"
        raise BrigadeError(f"--dp {dp} × --pp {p.pp} = {dp * p.pp} but the world size is {size} ({where}): "
                           f"the world size must equal dp × pp{fix}")
    out = dataclasses.replace(cfg, parallel=dataclasses.replace(p, dp=dp, nproc=nproc, nnodes=nnodes))
    if p.min_nodes:
        elastic.check_range(out.parallel, given, world is not None, lambda n, d: _check_batch(out, d, n))
    _check_batch(out, dp)
    return out


def _launcher_nodes(p: ParallelConfig, world: World, given: Collection[str]) -> tuple[int, int]:
    """(processes on this node, nodes) as the launcher started them; a given flag must agree."""
    local = world.local or world.size
    if "nproc" in given and p.nproc != local:
        raise BrigadeError(f"--nproc {p.nproc} but {world.launcher} started {local} processes on this node: "
                           f"leave --nproc out under {world.launcher}, or have it start {p.nproc} per node")
    if p.min_nodes:  # elastic: nodes stays MAX, the launcher's count must lie in the range
        return elastic.launcher_nodes(p, world)
    nnodes = world.size // local if world.size % local == 0 else p.nnodes
    if "nnodes" in given and p.nnodes != nnodes:
        raise BrigadeError(f"--nnodes {p.nnodes} but {world.launcher} started {world.size} processes, "
                           f"{local} per node: leave --nnodes out under {world.launcher}")
    return local, nnodes


def _check_batch(cfg: RunConfig, dp: int, nodes: int = 0) -> None:
    """The global batch must split evenly over replicas and accumulation, then micro-batches."""
    p, t, k = cfg.parallel, cfg.train, elastic.accumulation(cfg, dp)
    if t.batch_size % (dp * k):
        raise BrigadeError(f"--batch-size {t.batch_size} does not split evenly over dp {dp} × grad-accum "
                           f"{k}: use a multiple of {dp * k}")
    per_replica, where = t.batch_size // (dp * k), f" on {nodes} node(s)" if nodes else ""
    if p.pp * p.local_stages > 1 and p.microbatches > per_replica:
        raise BrigadeError(f"--microbatches {p.microbatches} is larger than each replica's batch "
                           f"({per_replica}{where}): use at most {per_replica} or a larger --batch-size")


def _positive(name: str, value: float, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        raise BrigadeError(f"--{name.replace('_', '-')} {value}: must be {'≥ 0' if zero_ok else '≥ 1'}")


def parse_endpoint(text: str) -> tuple[str, int]:
    """``"10.0.0.1:29500"`` → ("10.0.0.1", 29500).

    Raises:
        BrigadeError: not HOST:PORT.
    """
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BrigadeError(f"--rdzv-endpoint {text!r}: expected HOST:PORT of node 0, like 10.0.0.1:29500")
    return host.strip("[]"), int(port)


def validate(cfg: RunConfig) -> None:
    """Checks that need no model, data, processes or world (see `resolve_layout`); changes nothing.

    Raises:
        BrigadeError: naming the value, what was expected, and how to fix it.
    """
    m, d, p, o, t = cfg.model, cfg.data, cfg.parallel, cfg.optim, cfg.train
    for name in ("n_layer", "n_head", "n_embd", "context"):
        _positive(name, getattr(m, name))
    for name in ("nproc", "pp", "local_stages", "microbatches", "threads", "grad_accum", "hang_timeout"):
        _positive(name, getattr(p, name) if hasattr(p, name) else getattr(o, name))
    for name in ("max_steps", "batch_size", "eval_every", "eval_batches", "keep"):
        _positive(name, getattr(t, name))
    from brigade.train.precision import autocast_dtype  # owns the names; raises on an unknown one
    autocast_dtype(t.precision, t.bf16, "cpu")
    _positive("block_size", d.block_size)
    for name, value in (("dp", p.dp), ("max_restarts", p.max_restarts), ("lr", o.lr),
                        ("warmup_steps", o.warmup_steps), ("grad_clip", o.grad_clip),
                        ("snapshot_every", t.snapshot_every), ("sample_tokens", t.sample_tokens)):
        _positive(name, value, zero_ok=True)
    if not 0 <= m.dropout < 1:
        raise BrigadeError(f"--dropout {m.dropout}: must be in [0, 1)")
    if not 0 < d.val_fraction < 1:
        raise BrigadeError(f"--val-fraction {d.val_fraction}: must be between 0 and 1")
    if d.block_size > m.context:
        raise BrigadeError(
            f"--block-size {d.block_size} is larger than the model's context {m.context}: "
            f"use --block-size ≤ {m.context} or raise --context"
        )
    if m.n_embd % m.n_head:
        raise BrigadeError(f"--n-embd {m.n_embd} is not a multiple of --n-head {m.n_head}")
    if p.schedule not in ("gpipe", "1f1b", "zb"):
        raise BrigadeError(f"--schedule {p.schedule!r}: expected gpipe, 1f1b or zb")
    _positive("nnodes", p.nnodes)
    if not 0 <= p.node_rank < p.nnodes:
        raise BrigadeError(f"--node-rank {p.node_rank}: must be between 0 and --nnodes - 1 ({p.nnodes - 1})")
    if p.nnodes > 1 and (p.rdzv_endpoint or not p.min_nodes):  # elastic under torchrun: none needed
        parse_endpoint(p.rdzv_endpoint)
    if p.pp > 1 and p.local_stages > 1:
        raise BrigadeError("--pp > 1 with --local-stages > 1 is not supported: use one or the other")
