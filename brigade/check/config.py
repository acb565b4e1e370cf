"""What `brigade check` is asked (`CheckConfig`, one field a flag, its sentence the help) and what
it answers (`CheckResult`); a case of it (`Case`) and the case's full form (`case_of`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from brigade.config import ModelConfig, ParallelConfig
from brigade.config.fielddoc import (
    CHUNKED_LOSS,
    CP_METHODS,
    FLOAT8,
    MODELS,
    RECOMPUTES,
    SCHEDULES,
    VIRTUALS,
    doc,
    sentence,
)
from brigade.errors import BrigadeError

Case = tuple  # (schedule, m[, virtual[, recompute]]); virtual 0: the schedule's own V


@dataclass
class CheckConfig:
    """One case of `brigade check`; each field's sentence is its flag's help (`fielddoc.doc`)."""

    model: str = doc("gpt", "the model to check", choices=MODELS)
    stages: int = doc(2, "pipeline ranks (pp); the model is cut into stages × V pieces")
    schedule: str = doc("1f1b", sentence(ParallelConfig, "schedule"), choices=SCHEDULES)
    microbatches: int = doc(4, "micro-batches the batch is split into")
    runtime: str = doc("process", "process: one process per stage; local: one thread per device, "
                                  "all in this process")
    batch_size: int = doc(8, "samples in the one batch both sides compute, split over the --dp replicas")
    balance: list[int] | None = doc(None, "blocks per piece, stages × V entries like 3,5; unset: "
                                          "balance by --balance-by")
    seed: int = doc(0, "seed of the weights and the batch, the same on both sides")
    atol: float = doc(1e-5, "largest absolute difference of the loss, a gradient or a parameter "
                            "that still passes")
    model_options: dict = doc(help="options for the model's builder (gpt_cfg, image_size), set per "
                                   "model by the command", factory=dict)
    balance_by: str = doc("params", "without --balance: balance parameter counts (params) or "
                                    "measured time (time)")
    devices: list[str] | None = doc(None, "local runtime: one device per stage, like cpu,cuda:0; "
                                          "unset: a GPU each when there are enough, else the CPU")
    virtual: int = doc(0, sentence(ParallelConfig, "virtual"), choices=VIRTUALS)
    dp: int = doc(1, "data-parallel replicas, each on its slice of the batch (dp × stages processes)")
    shard: int = doc(1, sentence(ParallelConfig, "shard"))
    tp: int = doc(1, sentence(ParallelConfig, "tp") + " (dp × stages × tp processes)")
    ep: int = doc(1, sentence(ParallelConfig, "ep"))
    cp: int = doc(1, sentence(ParallelConfig, "cp") + " (dp × stages × cp × tp processes)")
    cp_method: str = doc("auto", sentence(ParallelConfig, "cp_method"), choices=CP_METHODS)
    recompute: str = doc("none", sentence(ParallelConfig, "recompute"), choices=RECOMPUTES)
    reshard: bool = doc(False, sentence(ParallelConfig, "reshard"))
    sequence_parallel: bool = doc(True, sentence(ParallelConfig, "sequence_parallel"))
    compile: bool = doc(False, sentence(ParallelConfig, "compile").split(";")[0])
    float8: str = doc("", "float8 matmuls in the body's linear layers ({choices}), against the same "
                          "float8 model on one device, micro-batch by micro-batch (each micro-batch's "
                          "scales its own); empty: none", choices=FLOAT8)
    chunked_loss: str = doc("auto", sentence(ParallelConfig, "chunked_loss"), choices=CHUNKED_LOSS)
    loss_chunk: int = doc(1024, sentence(ParallelConfig, "loss_chunk"))
    experts: int = doc(0, sentence(ModelConfig, "experts"))
    top_k: int = doc(2, sentence(ModelConfig, "top_k"))
    lora: int = doc(0, "adapters of this rank on the attention and MLP projections, the rest frozen, "
                       "on both sides; their B drawn at random, not zero as training starts it, so "
                       "both adapters have gradients to compare; 0: no LoRA")
    documents: bool = doc(False, "pack a few documents into each checked sequence (the gpt and hf:DIR "
                                 "models): attention within each, positions restarting at each, as "
                                 "training on a shard set does (--document-mask)")


@dataclass
class CheckResult:
    schedule: str
    microbatches: int
    stages: int
    runtime: str
    balance: list[int]
    loss: float
    max_abs_loss_diff: float
    max_abs_grad_diff: float
    max_abs_param_diff: float
    reference: str
    ok: bool
    virtual: int = 1
    dp: int = 1
    reference_device: str = "cpu"
    shard: int = 1
    recompute: str = "none"
    tp: int = 1
    sequence_parallel: bool = False
    ep: int = 1
    cp: int = 1
    cp_method: str = ""
    lora: int = 0
    loss_chunks: int = 0  # the chunks the head's loss ran in (`parallel.chunked`; 0: not chunked)

    def to_dict(self) -> dict:
        return asdict(self)


def model_options(cfg: CheckConfig) -> dict:
    """What the model's builder is given (`models.load_model`): the command's per-model options,
    and `documents` where asked for."""
    return {**cfg.model_options, **({"documents": True} if cfg.documents else {})}


def case_of(cfg: CheckConfig, case: Case) -> tuple[str, int, int, str]:
    """(schedule, m, virtual, recompute): a case without V or recompute takes the config's."""
    return (*case, cfg.virtual, cfg.recompute)[:4] if len(case) < 3 else (*case, cfg.recompute)[:4]


def adapters_of(cfg: CheckConfig):
    """--lora's adapters for both sides of the check (`parallel.lora.LoraSpec`), B drawn; None
    without --lora.

    Raises:
        BrigadeError: a negative rank.
    """
    from brigade.parallel.lora import LoraSpec

    if cfg.lora < 0:
        raise BrigadeError(f"--lora {cfg.lora}: the adapters' rank must be ≥ 1; 0 checks without LoRA")
    return LoraSpec(cfg.lora, seed=cfg.seed, draw_b=True) if cfg.lora else None
