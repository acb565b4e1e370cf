"""The run configuration's sections: one dataclass per component, composed into `RunConfig`,
and the part of it a snapshot must agree with to be resumed (`config_subset`, `config_hash`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass, field, fields


@dataclass
class ModelConfig:
    model: str = "gpt"  # gpt, toy, mlp, resnet50, or path/to/file.py:factory
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    context: int = 128  # the model's longest sequence (positions it knows)
    dropout: float = 0.0
    tie_embeddings: bool = True  # gpt: the head reuses the token embedding's weight (--no-tie-embeddings)


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
    schedule: str = "1f1b"  # a name in pipeline.schedule's registry (brigade schedule --help)
    virtual: int = 0  # stages per pipeline rank; 0: the schedule's own (1, or 2 for multi-stage ones)
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


def section_classes() -> dict[str, type]:
    """Section name → its dataclass, in `RunConfig`'s order."""
    hints = typing.get_type_hints(RunConfig)
    return {name: hints[name] for name in SECTIONS}


def field_types(cls: type) -> dict[str, type]:
    """Field name → type of a section's dataclass."""
    return {k: v for k, v in typing.get_type_hints(cls).items()}


# What a snapshot must agree on to be resumed; the layout and run length may change.
_HASHED = {"model": None, "data": None, "optim": None, "train": ("batch_size", "seed")}


def config_subset(cfg: RunConfig) -> dict:
    """The sections and keys a snapshot must match to resume `cfg` (the manifest's `config`)."""
    d = cfg.to_dict()
    return {s: {k: v for k, v in d[s].items() if keys is None or k in keys} for s, keys in _HASHED.items()}


def config_hash(cfg: RunConfig) -> str:
    """A short hash of `config_subset(cfg)`: equal hashes, compatible snapshots."""
    return hashlib.sha256(json.dumps(config_subset(cfg), sort_keys=True).encode()).hexdigest()[:16]


