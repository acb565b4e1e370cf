"""What `brigade plan` is asked: the model, the batch, the cluster and the layout space. Each
field's sentence is its flag's help (`config.fielddoc`)."""

from __future__ import annotations

from dataclasses import dataclass

from brigade.config.fielddoc import CHUNKED_LOSS, CP_METHODS, MODELS, RECOMPUTES, SCHEDULES, Choices, doc

COST_SOURCES = Choices(lambda: ("auto", "measured", "formula"))


@dataclass
class PlanConfig:
    model: str = doc("gpt", "the model to plan for", choices=MODELS)
    batch_size: int = doc(32, "global batch in sequences (or samples), split across data-parallel replicas")
    seq_len: int = doc(128, "gpt: sequence length in tokens (its context and block size)")
    nodes: int = doc(1, "machines in the target cluster")
    gpus_per_node: int = doc(2, "devices (processes) per machine")
    device: str = doc(
        "cpu", "the target device: h100, h200, a100 or cpu (this machine, measured by a short probe)"
    )
    reprobe: bool = doc(False, "--device cpu: measure this machine again instead of reusing its probe "
                               "from the last day (kept in ~/.cache/brigade, or $BRIGADE_CACHE_DIR)")
    cluster: str = doc(
        "",
        "a TOML file with nodes, devices_per_node and a [device] table (docs/plan.md); "
        "empty: --nodes, --gpus-per-node and --device",
    )
    precision: str = doc("", "the training precision whose peak counts: empty (fp32) or bf16")
    costs: str = doc(
        "auto",
        "where the blocks' costs come from ({choices}): measured here (then scaled), formula (from "
        "the model's shapes on the meta device, each kernel at its published rate), auto: formula "
        "when the model would not fit this machine, else measured",
        choices=COST_SOURCES,
    )
    schedules: str = doc(
        "",
        "pipeline schedules to consider, comma-separated ({choices}); empty: every registered one",
        choices=SCHEDULES,
    )
    microbatches: str = doc(
        "", "micro-batch counts to consider, like 1,2,4; empty: powers of two up to 4 × pp"
    )
    recompute: str = doc(
        "none,full", "recompute modes to consider, comma-separated ({choices})", choices=RECOMPUTES
    )
    compile: bool = doc(False, "plan for runs with --compile: blocks measured here are compiled before "
                               "they are timed (scaled to another device as measured); costs from "
                               "shapes fuse the memory-bound ops between two matmuls, as Inductor does")
    float8: bool = doc(False, "plan for runs with float8 linear layers (tensorwise scaling): costs from "
                              "shapes run every block's linear layers but the head's at the target's "
                              "float8 peak, with their scaling passes")
    chunked_loss: str = doc("auto", "plan for runs whose head's loss is chunked as training's "
                                    "--chunked-loss decides ({choices}): costs from shapes then hold "
                                    "one chunk's logits, not the sequence's, and run the head's "
                                    "forward again in its backward", choices=CHUNKED_LOSS)
    loss_chunk: int = doc(1024, "positions of each sequence a chunk of the head's loss takes, as "
                                "training's --loss-chunk")
    dp: int = doc(0, "consider only this data-parallel width; 0: every divisor of the world")
    pp: int = doc(0, "consider only this pipeline depth; 0: every divisor of the world")
    shard: int = doc(0, "consider only this shard degree (1: DDP); 0: every divisor of dp")
    tp: int = doc(0, "consider only this tensor-parallel degree (1: none); 0: every one the model's "
                     "tp plans allow that divides a node's devices")
    ep: int = doc(0, "consider only this expert-parallel degree (1: none), for a mixture of experts; 0: "
                     "every divisor of dp that divides every MoE layer's expert count (1 alone for a "
                     "dense model)")
    cp: int = doc(0, "consider only this context-parallel degree (1: none): each sequence split over cp "
                     "processes; 0: every power of two up to a node's devices ÷ tp that the sequence and, "
                     "under all-to-all, the attention heads split into (1 alone without attention)")
    cp_method: str = doc("auto", "how attention exchanges under cp, as training's --cp-method ({choices}): "
                                 "all-to-all (heads ÷ tp split into cp) or ring (CUDA); auto: ring on a "
                                 "GPU target, all-to-all on cpu", choices=CP_METHODS)
    top: int = doc(10, "rows of the ranked table printed")
    write_config: str = doc(
        "", "write the best row that fits as a train config TOML here (brigade train --config FILE)"
    )
