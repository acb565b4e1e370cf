"""torchtitan 0.3.0, the other side of scripts/gpu-compare.sh: its Llama 3 "1B" as it builds it, the
two runs the comparison asks of its trainer, and the lines its trainer logs.

    python -m torch.distributed.run --standalone --nproc-per-node 1 -m torchtitan.train \\
        --module brigade.results.titan --config compare_bf16 --training.steps 40 ...

torchtitan 0.3.0 is configured by Python functions that its command line names (--module, --config)
and overrides field by field (--training.steps 40); `compare_bf16` and `compare_float8` are two such
functions. Each starts from torchtitan's own Llama 3 recipe (`llama3_8b`: its chunked loss, fused
AdamW and bf16 mixed precision) so that torchtitan runs as its users run it, and changes only what
the comparison fixes: the "1B" model, sequence 2048, compiled, no activation recomputation (brigade's
default too), and nothing that is not training (checkpoints, validation, profiling, TensorBoard), a
line logged every step. Float8 is torchao's rowwise recipe on both sides (torchtitan 0.3.0 has no
tensorwise one) on the blocks' linear layers only: the output head stays bf16, as brigade keeps it.

torchtitan is imported inside the functions only: it lives in the comparison's own environment
(the script makes it), and nothing of brigade needs it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
import types

VERSION = "0.3.0"  # the release the comparison runs (scripts/gpu-compare.sh installs exactly this one)
FLAVOR = "1B"  # torchtitan's Llama 3 flavors: debugmodel, 1B, 3B, 8B, 70B, 405B
SEQ_LEN = 2048
RECIPE = "rowwise"  # torchtitan 0.3.0's float8 recipes: rowwise, rowwise_with_gw_hp
KEPT = ("lm_head",)  # linear layers float8 leaves alone (a substring of their names)
MODES = ("bf16", "float8")
# torchtitan's module of expert-parallel kernels for mixture-of-experts models, which imports triton
# when torchtitan's model code is imported; see `_stand_in_for_moe_kernels`.
MOE_KERNELS = "torchtitan.distributed.minimal_async_ep"


def installed() -> str | None:
    """The torchtitan version this Python sees, None if none."""
    try:
        return importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        return None


def _absent(name: str):
    if name.startswith("__"):  # what inspect and importlib ask every module: a real answer
        raise AttributeError(name)
    return _NotHere


class _NotHere:
    """What the stand-in module's names are: anything that calls one fails at once."""

    def __init__(self, *_args, **_kwargs):
        raise RuntimeError(f"{MOE_KERNELS} was stood in for (triton is not installed): it cannot run here")


_STAND_IN = "brigade's stand-in: triton is not installed (brigade.results.titan)"


def _stand_in_for_moe_kernels() -> None:
    """Where triton is missing (torch's CPU builds), stand in for torchtitan's expert-parallel kernels.

    torchtitan 0.3.0's model code imports, through its mixture-of-experts layer, a module of triton
    kernels that only expert-parallel MoE runs call; a dense Llama never does, but the import alone
    fails without triton, so the CPU check could not build the model at all. Only that one module
    is replaced (by one whose every name fails when used), and only where triton is absent: torch's
    own probes for triton still find none.
    """
    if MOE_KERNELS in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    stand_in = types.ModuleType(MOE_KERNELS, _STAND_IN)
    stand_in.__path__ = []
    stand_in.__getattr__ = _absent
    sys.modules[MOE_KERNELS] = stand_in


def stood_in() -> bool:
    """Whether this process imports torchtitan's model code with its MoE kernels stood in for."""
    return getattr(sys.modules.get(MOE_KERNELS), "__doc__", None) == _STAND_IN


def llama3():
    """torchtitan's Llama 3 model registry (`model_registry(flavor, converters=...)`)."""
    _stand_in_for_moe_kernels()
    from torchtitan.models.llama3 import model_registry

    return model_registry


def float8_converter(emulate: bool = False):
    """torchtitan's float8 swap as the comparison asks it: rowwise, every linear layer but the
    head, compiled. `emulate` (no compile, torchao's emulated matmuls) lets a CPU build the swapped
    model's configuration to see which layers it swaps; the GPU run never emulates."""
    from torchtitan.components.quantization import Float8LinearConverter

    return Float8LinearConverter.Config(recipe_name=RECIPE, filter_fqns=list(KEPT), emulate=emulate,
                                        model_compile_enabled=not emulate)


def model_config(float8: bool = False, emulate: bool = False):
    """The "1B" model's configuration (a `Llama3Model.Config`), float8 layers swapped in if asked."""
    return llama3()(FLAVOR, converters=[float8_converter(emulate)] if float8 else None).model


def shape(cfg) -> dict:
    """A model configuration's shape in the comparison's own terms (gpu_compare.SHAPE's keys)."""
    block = cfg.layers[0]
    attention, rope = block.attention, block.attention.rope
    return {"dim": cfg.dim, "n_layers": len(cfg.layers), "n_heads": attention.n_heads,
            "n_kv_heads": attention.n_kv_heads, "head_dim": cfg.dim // attention.n_heads,
            "ffn_dim": block.feed_forward.w1.out_features, "vocab_size": cfg.vocab_size,
            "tied": cfg.enable_weight_tying, "norm_eps": block.attention_norm.eps,
            "context": rope.max_seq_len, "rope_theta": float(rope.theta),
            "rope_scaling": "llama3" if rope.scaling == "llama" else rope.scaling,
            "rope_factor": rope.scaling_factor, "rope_low_freq_factor": rope.low_freq_factor,
            "rope_high_freq_factor": rope.high_freq_factor,
            "rope_original_context": rope.original_max_position_embeddings}


def count_parameters(cfg) -> int:
    """The parameters of the model `cfg` builds, on the meta device (no memory); a tied weight once."""
    import torch

    with torch.device("meta"):
        model = cfg.build()
    return sum(p.numel() for p in model.parameters())


def swapped(cfg) -> list[str]:
    """The names of the linear layers a float8 configuration computes in float8."""
    from torchtitan.components.quantization import Float8Linear

    return [fqn for fqn, *_ in cfg.traverse(Float8Linear.Config)]


def _run(float8: bool):
    """torchtitan's Llama 3 recipe, changed only where the comparison fixes a setting (module doc)."""
    from torchtitan.config import CompileConfig
    from torchtitan.models.llama3.config_registry import llama3_8b

    config = llama3_8b()
    config.model_spec = llama3()(FLAVOR, converters=[float8_converter()] if float8 else None)
    config.compile = CompileConfig(enable=True)
    config.activation_checkpoint = None
    config.training.seq_len = SEQ_LEN
    config.dataloader.dataset = "c4_test"  # its local-files loader: {"text": ...} lines of --dataset_path
    config.checkpoint.enable = config.validator.enable = False
    config.profiler.enable_profiling = config.metrics.enable_tensorboard = False
    config.metrics.log_freq, config.metrics.disable_color_printing = 1, True
    return config


def compare_bf16():
    """The bf16 run (torchtitan calls this: --module brigade.results.titan --config compare_bf16)."""
    return _run(float8=False)


def compare_float8():
    """The float8 run: compare_bf16 with the blocks' linear layers in float8 (rowwise)."""
    return _run(float8=True)


def flags(steps: int, batch: int, model_dir: str, text_dir: str, dump: str) -> list[str]:
    """What a run sets on torchtitan's command line: its length, batch and folders."""
    return ["--training.steps", str(steps), "--training.local_batch_size", str(batch),
            "--hf_assets_path", model_dir, "--dataloader.dataset_path", text_dir, "--dump_folder", dump]


def argv(mode: str, run_flags: list[str]) -> list[str]:
    """torchtitan's trainer on one GPU, as its own launcher starts it (after the Python to use)."""
    return ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "torchtitan.train",
            "--module", __name__, "--config", f"compare_{mode}", *run_flags]


def parse(mode: str, run_flags: list[str]):
    """The configuration torchtitan's command line makes of `argv(mode, run_flags)`: what the CPU
    check reads back to see that torchtitan accepts the run's flags and runs what they say."""
    llama3()  # the stand-in, if one is needed, before torchtitan's config imports its models
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--module", __name__, "--config", f"compare_{mode}", *run_flags])


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[-\d.naif]+)\s+grad_norm:\s*[-\d.naif]+\s+"
                   r"memory:\s*(?P<gib>[\d.]+)GiB\([\d.]+%\)\s+tps:\s*(?P<tps>[\d,]+)\s+"
                   r"tflops:\s*(?P<tflops>[\d,.]+)\s+mfu:\s*(?P<mfu>[\d.]+%|N/A)")


def read_log(text: str) -> list[dict]:
    """The training steps torchtitan's log shows, one dict each: step, loss, tokens_per_s (per GPU,
    over the time since the line before), tflops, mfu (a fraction; None where torchtitan gives none,
    as under float8) and reserved_gib (the allocator's peak reserved memory since the line before).

    torchtitan 0.3.0 writes a step as `step: 5  loss:  7.1  grad_norm:  1.3  memory: 30.2GiB(21.6%)
    tps: 12,345  tflops: 95.6  mfu: 9.7%` (colours off here; stripped if on). Validation lines
    ("validate step: ...") are not training steps and are left out."""
    steps = []
    for line in _ANSI.sub("", text).splitlines():
        m = _STEP.search(line)
        if m is None or "validate step" in line:
            continue
        mfu = m["mfu"]
        steps.append({"step": int(m["step"]), "loss": float(m["loss"]),
                      "tokens_per_s": float(m["tps"].replace(",", "")),
                      "tflops": float(m["tflops"].replace(",", "")),
                      "mfu": None if mfu == "N/A" else float(mfu.rstrip("%")) / 100,
                      "reserved_gib": float(m["gib"])})
    return steps
