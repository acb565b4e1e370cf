"""The run configuration's sections: one dataclass per component, composed into `RunConfig`,
and the part of it a snapshot must agree with to be resumed (`config_subset`, `config_hash`).

Each field carries its one sentence (`fielddoc.doc`): `brigade train --help` and the comments of
the TOML file a run writes both read it, so the two cannot drift."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass, field, fields

from brigade.config.fielddoc import (
    CHUNKED_LOSS,
    CP_METHODS,
    FLOAT8,
    LOGS,
    LR_SCHEDULES,
    MODELS,
    PRECISIONS,
    RECOMPUTES,
    SCHEDULES,
    SNAPSHOT_ERRORS,
    UPDATES,
    VIRTUALS,
    doc,
)


@dataclass
class ModelConfig:
    model: str = doc("gpt", "the model to train", choices=MODELS)
    n_layer: int = doc(4, "gpt: transformer blocks")
    n_head: int = doc(4, "gpt: attention heads per block (they divide --n-embd)")
    n_embd: int = doc(128, "gpt: width of the embeddings and of each block")
    context: int = doc(128, "gpt: the longest sequence the model knows positions for")
    dropout: float = doc(0.0, "dropout probability in training, from 0 (none) up to 1")
    tie_embeddings: bool = doc(True, "gpt: the output head reuses the token embedding's weight "
                                     "(--no-tie-embeddings gives each its own)")
    experts: int = doc(0, "gpt: experts in each block's feed-forward, a mixture of experts that sends "
                          "each token to --top-k of them; 0: one dense feed-forward")
    top_k: int = doc(2, "gpt with --experts: the experts each token goes to, from 1 to --experts")
    lora: int = doc(0, "train low-rank adapters of this rank on the attention and MLP projections, "
                       "every other weight frozen (8 or 16 are usual); 0: train every weight")
    lora_alpha: float = doc(16.0, "with --lora: the adapters' update is scaled by alpha / rank")
    lora_dropout: float = doc(0.0, "with --lora: dropout on the adapters' input, from 0 up to below 1")
    lora_targets: str = doc("", "with --lora: the linear layers to adapt, comma-separated names or their "
                                "last parts (q_proj,v_proj or attn.qkv); empty: the attention and MLP "
                                "projections")


@dataclass
class DataConfig:
    data: str = doc("", "a UTF-8 text file to train on, character by character; an hf:DIR model "
                        "takes a shard set from brigade tokenize, or any corpus it reads (tokenized "
                        "into OUT/tokens first); several mixed by weight as a.txt:0.7,b.txt:0.3; "
                        "empty: CPython's pydoc topics, which every machine has")
    block_size: int = doc(128, "training sequence length in characters (hf:DIR: tokens), at most "
                               "--context (hf:DIR: its positions)")
    val_fraction: float = doc(0.1, "share of the text held out for the validation loss, between 0 and 1")
    val_data: str = doc("", "a held-out text (an hf:DIR model: a corpus or a shard set) for the validation "
                            "loss instead of --data's last --val-fraction, all of which then trains")
    document_mask: bool = doc(True, "an hf:DIR model's shard sets: attention stays within each document "
                                    "a window packs, and positions restart at each "
                                    "(--no-document-mask: windows attend across documents); a "
                                    "character text has no documents and is unaffected")


@dataclass
class ParallelConfig:
    nproc: int = doc(2, "processes to start on this node (under torchrun or Slurm: the launcher's)")
    nnodes: int = doc(1, "machines in the run, each running brigade train with its own --node-rank; "
                         "MIN:MAX for an elastic run that goes on when machines are lost and grows "
                         "when they come back (needs --max-restarts ≥ 1, one restart per machine lost)")
    min_nodes: int = doc(0, "elastic: fewest machines to train on, the MIN of --nnodes MIN:MAX; "
                            "0: not elastic, exactly --nnodes")
    node_rank: int = doc(0, "this machine's place among --nnodes, from 0 (node 0 hosts the rendezvous)")
    rdzv_endpoint: str = doc("", "HOST:PORT of node 0's rendezvous, needed for --nnodes > 1")
    local_addr: str = doc("", "the address this node advertises to the others; empty: the one that "
                              "routes to node 0")
    dp: int = doc(0, "data-parallel replicas, each on its slice of the batch; 0: derive it as "
                     "world size ÷ (--pp × --cp × --tp)")
    shard: int = doc(1, "of each stage's --dp data-parallel processes, how many shard its parameters, "
                        "gradients and optimizer state between them (FSDP2); the others replicate "
                        "those shards (HSDP when both are > 1); 1: no sharding (DDP)")
    ep: int = doc(1, "expert parallel: the processes a mixture of experts' experts are split over, "
                     "taken from the --dp data-parallel ones (each holds experts ÷ ep; tokens reach "
                     "their experts by all-to-all); dense weights keep their sharding; 1: none")
    cp: int = doc(1, "context parallel: the processes each sequence is split over, T ÷ cp positions "
                     "each (activations ÷ cp); attention exchanges by --cp-method; they share a stage's "
                     "weights as replicas do (FSDP2 shards over --shard × cp); 1: none")
    cp_method: str = doc("auto", "how attention reaches the other parts of a sequence under --cp "
                                 "({choices}): all-to-all over heads (needs the heads ÷ tp divisible by "
                                 "cp), or ring attention (CUDA); auto: ring on GPUs, all-to-all on CPU",
                         choices=CP_METHODS)
    tp: int = doc(1, "tensor-parallel processes each block's matmuls are split over (DTensor), the "
                     "innermost mesh dimension, so on the fastest links; the model's blocks say how "
                     "(a tp_plan); 1: none")
    sequence_parallel: bool = doc(True, "with --tp: split the norms, residual stream and dropout "
                                        "along the sequence where the blocks' plans allow (1/tp of "
                                        "their activations and of what the pipeline sends); "
                                        "--no-sequence-parallel keeps them whole on every tp process")
    reshard: bool = doc(False, "with --shard under a pipeline: free a stage's gathered parameters after "
                               "each forward (less memory; an all-gather per micro-batch, not per step); "
                               "without a pipeline each block's always are")
    recompute: str = doc("none", "activation recomputation of every block ({choices}); a model file's "
                                 "recompute = {index: mode} sets it per block", choices=RECOMPUTES)
    compile: bool = doc(False, "compile each block on its own (torch.compile), after tensor parallel "
                               "and recompute, before sharding; the first steps wait for the "
                               "compiler, restarts reuse OUT/compile-cache (or "
                               "$BRIGADE_COMPILE_CACHE where set)")
    float8: str = doc("", "float8 matmuls in the body's linear layers, through torchao ({choices}; "
                          "pip install 'brigade[float8]'); the first block and the head stay in full "
                          "precision, and the run's first lines list what converted; empty: none",
                      choices=FLOAT8)
    chunked_loss: str = doc("auto", "run the head inside the loss, --loss-chunk positions at a time, "
                                    "each chunk's logits made again in backward, so a step holds one "
                                    "chunk's logits, not the sequence's, for one more forward of the "
                                    "head ({choices})", choices=CHUNKED_LOSS)
    loss_chunk: int = doc(1024, "positions of each sequence (of this process's part, under sequence or "
                                "context parallel) the chunked head's loss takes at a time")
    pp: int = doc(1, "pipeline stages, one process each (1: no pipeline across processes)")
    local_stages: int = doc(1, "pipeline stages inside each process, one thread and device each")
    schedule: str = doc("1f1b", "the pipeline schedule (brigade schedule draws one)", choices=SCHEDULES)
    virtual: int = doc(0, "stages per pipeline rank; 0: the schedule's own ({choices})", choices=VIRTUALS)
    microbatches: int = doc(4, "micro-batches each replica's batch is split into for the pipeline")
    auto_limit: int = doc(0, "--schedule auto: the most micro-batch activations a pipeline rank holds "
                             "at once, one per stage it holds (at least V); 0: the least that keeps "
                             "the plan shortest")
    balance: str = doc("", "blocks per stage, like 3,3 (pp × V entries, stage 0's first); measured "
                           "(--schedule auto): the cut auto's plan runs best on, from the blocks' "
                           "times measured at the start and kept in snapshots; empty: balance the "
                           "parameter counts")
    backend: str = doc("auto", "the collective backend: auto, gloo or nccl; auto: nccl when GPUs "
                               "are visible, else gloo")
    threads: int = doc(1, "CPU threads per process (torch.set_num_threads)")
    max_restarts: int = doc(0, "times the workers are restarted from the newest snapshot after a "
                               "failure; 0: a failure ends the run")
    hang_timeout: int = doc(120, "seconds a collective or transfer may wait before the run fails")
    rdzv_timeout: int = doc(120, "seconds nodes wait for each other at a rendezvous (elastic: for MIN)")
    rdzv_last_call: int = doc(10, "elastic: seconds a rendezvous waits for more nodes once MIN are there")


@dataclass
class OptimConfig:
    lr: float = doc(3e-3, "peak learning rate of AdamW, reached after the warm-up")
    min_lr: float = doc(3e-4, "learning rate the decay ends at, on step --decay-steps, and holds after")
    warmup_steps: int = doc(50, "steps of linear warm-up from 0 to --lr; 0: start at --lr")
    lr_schedule: str = doc("cosine", "the learning rate after the warm-up ({choices})", choices=LR_SCHEDULES)
    decay_steps: int = doc(0, "the step the decay reaches --min-lr on; 0: --max-steps as the run first "
                              "started, kept in its snapshots (a resume with another --max-steps is "
                              "then refused unless this is given)")
    decay_fraction: float = doc(0.2, "wsd: the last part of the steps up to --decay-steps over which the "
                                     "rate decays, from 0 (excluded) to 1")
    weight_decay: float = doc(0.1, "AdamW's decoupled weight decay, on matrices only")
    beta1: float = doc(0.9, "AdamW's decay rate of the gradient's running mean")
    beta2: float = doc(0.99, "AdamW's decay rate of the squared gradient's running mean")
    grad_clip: float = doc(1.0, "largest norm of the whole model's gradient; 0: no clipping")
    adamw: str = doc("auto", "how AdamW updates the parameters ({choices}); config.toml names the "
                             "one a run resolved to", choices=UPDATES)
    grad_accum: int = doc(1, "chunks each replica's share of the global batch is cut into, one "
                              "forward and backward each, gradients summed before one optimizer step")


@dataclass
class TrainConfig:
    max_steps: int = doc(1000, "optimizer steps to train for")
    batch_size: int = doc(32, "global batch in sequences, split across data-parallel replicas")
    seed: int = doc(0, "seed of the weights and the data order: the same seed, the same run")
    eval_every: int = doc(200, "steps between validation losses")
    eval_batches: int = doc(8, "batches each validation loss averages")
    out: str = doc("runs/latest", "folder for the metrics, snapshots, config.toml and sample")
    sample_tokens: int = doc(300, "tokens (characters) of text sampled at the end; 0: no sample")
    snapshot_every: int = doc(100, "steps between snapshots; 0: only at the end")
    snapshot_minutes: float = doc(float("inf"), "minutes of wall time after which a snapshot is "
                                                "taken even before --snapshot-every's step; inf: by "
                                                "steps only")
    snapshot_async: bool = doc(True, "write snapshots in the background while training goes on: a step "
                                     "waits only for the copy to memory (--no-snapshot-async: every "
                                     "rank waits until the snapshot is on disk)")
    on_snapshot_error: str = doc("stop", "a snapshot that cannot be written (disk full or read-only): "
                                         "{choices}; stop ends the run, warn says so and trains on; "
                                         "either way the newest complete snapshot is kept",
                                 choices=SNAPSHOT_ERRORS)
    stop_grace: float = doc(30.0, "seconds between a stop signal (SIGTERM, preemption) and the kill "
                                  "that follows: a snapshot being written is given half of them to "
                                  "finish, else it is abandoned")
    keep: int = doc(2, "complete snapshots kept, the newest ones (one being written does not count)")
    tensorboard: bool = doc(False, "also write OUT/tensorboard event files "
                                   "(pip install 'brigade[tensorboard]')")
    log: str = doc("", "also send the metrics to each of {choices}, comma-separated (pip install "
                       "'brigade[wandb]', 'brigade[mlflow]'); W&B and MLflow read their usual "
                       "environment variables (WANDB_PROJECT, WANDB_MODE, MLFLOW_TRACKING_URI)",
                   choices=LOGS)
    mfu: bool = doc(True, "count the model's FLOPs at the start (on the meta device: about a second "
                          "the first time a process uses it) and log MFU each step (--no-mfu: tokens/s "
                          "alone)")
    peak_tflops: float = doc(0.0, "each device's peak TFLOP/s that the log's MFU is held to; 0: an H100's, "
                                  "H200's or A100's from the planner's table, on a CPU one core's "
                                  "measured at the start (× --threads), on another GPU no MFU")
    bf16: bool = doc(True, "autocast to bf16 on GPUs, ignored on the CPU and when --precision is given")
    precision: str = doc("", "autocast type on any device: {choices}, fp16 with loss scaling; empty: "
                             "follow --bf16", choices=PRECISIONS)


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


# What a snapshot must agree on to be resumed; the layout and run length may change, and so may
# the step the learning rate's decay ends on, where the user says so (`config.lr`).
_HASHED = {"model": None, "data": None, "optim": None, "train": ("batch_size", "seed")}
_UNHASHED = {"optim": ("decay_steps",)}
# Keys that change what is trained only for some models: elsewhere left out, so that toggling
# them does not refuse a resume, and a snapshot written before they existed keeps its hash.
_HF_ONLY = {"data": ("document_mask",)}


def config_subset(cfg: RunConfig) -> dict:
    """The sections and keys a snapshot must match to resume `cfg` (the manifest's `config`)."""
    d = cfg.to_dict()
    left = {s: (*_UNHASHED.get(s, ()), *(() if cfg.model.model.startswith("hf:") else _HF_ONLY.get(s, ())))
            for s in _HASHED}
    kept = {s: [k for k in d[s] if (keys is None or k in keys) and k not in left[s]]
            for s, keys in _HASHED.items()}
    return {s: {k: d[s][k] for k in names} for s, names in kept.items()}


def config_hash(cfg: RunConfig) -> str:
    """A short hash of `config_subset(cfg)`: equal hashes, compatible snapshots."""
    return hashlib.sha256(json.dumps(config_subset(cfg), sort_keys=True).encode()).hexdigest()[:16]


