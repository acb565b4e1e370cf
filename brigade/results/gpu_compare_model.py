"""The model of scripts/gpu-compare.sh, as both sides build it, and what both train on.

The model is torchtitan's Llama 3 "1B" (`SHAPE`: Llama 3.2 1B's shapes, 1.24 B parameters, tied
embeddings, its rope scaled ×8 as torchtitan's flavor scales it). brigade reads it as a Hugging Face
directory (`--model hf:DIR`, DIR/config.json written from `SHAPE`); torchtitan builds its own flavor
(brigade.results.titan). `check` holds the two to the same shape and the same parameter count, built
on the meta device (no memory, so on any machine), and torchtitan to accepting the run's command
line; `write_model` and `write_text` make the directory and the text the GPU runs read.
"""

from __future__ import annotations

import json
from pathlib import Path

from brigade.errors import BrigadeError
from brigade.results import titan

# torchtitan's Llama 3 "1B" in the comparison's own terms (titan.shape and hf_shape speak them).
SHAPE = {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "head_dim": 64, "ffn_dim": 8192,
         "vocab_size": 128256, "tied": True, "norm_eps": 1e-5, "context": 131072, "rope_theta": 500000.0,
         "rope_scaling": "llama3", "rope_factor": 8.0, "rope_low_freq_factor": 1.0,
         "rope_high_freq_factor": 4.0, "rope_original_context": 8192}
TOKENIZER_VOCAB = 256  # byte-level (brigade.models.hf.tiny's tokenizer): ids far below the model's vocabulary
DOCUMENT_CHARS = 65536  # torchtitan masks attention at document ends: documents of 32 sequences and more
EOT = "<|endoftext|>"


def hf_config(shape: dict = SHAPE, eos: int = 0):
    """`shape` as a transformers LlamaConfig (what `--model hf:DIR` reads from DIR/config.json)."""
    from brigade.models.hf.deps import require

    rope = {"rope_type": shape["rope_scaling"], "rope_theta": shape["rope_theta"],
            "factor": shape["rope_factor"], "low_freq_factor": shape["rope_low_freq_factor"],
            "high_freq_factor": shape["rope_high_freq_factor"],
            "original_max_position_embeddings": shape["rope_original_context"]}
    return require("transformers").LlamaConfig(
        vocab_size=shape["vocab_size"], hidden_size=shape["dim"], intermediate_size=shape["ffn_dim"],
        num_hidden_layers=shape["n_layers"], num_attention_heads=shape["n_heads"],
        num_key_value_heads=shape["n_kv_heads"], head_dim=shape["head_dim"], rms_norm_eps=shape["norm_eps"],
        max_position_embeddings=shape["context"], tie_word_embeddings=shape["tied"], rope_parameters=rope,
        bos_token_id=None, eos_token_id=eos, pad_token_id=None)


def hf_shape(config) -> dict:
    """A transformers Llama config's shape in the comparison's terms (SHAPE's keys)."""
    rope = config.rope_parameters
    return {"dim": config.hidden_size, "n_layers": config.num_hidden_layers,
            "n_heads": config.num_attention_heads, "n_kv_heads": config.num_key_value_heads,
            "head_dim": config.head_dim, "ffn_dim": config.intermediate_size, "vocab_size": config.vocab_size,
            "tied": config.tie_word_embeddings, "norm_eps": config.rms_norm_eps,
            "context": config.max_position_embeddings, "rope_theta": float(rope["rope_theta"]),
            "rope_scaling": rope.get("rope_type"), "rope_factor": rope.get("factor"),
            "rope_low_freq_factor": rope.get("low_freq_factor"),
            "rope_high_freq_factor": rope.get("high_freq_factor"),
            "rope_original_context": rope.get("original_max_position_embeddings")}


def brigade_model(directory: Path) -> tuple[dict, int]:
    """The shape brigade reads from DIR and its parameter count, built on the meta device as a
    training rank builds it (`--model hf:DIR`), a tied weight counted once."""
    from torch import nn

    from brigade.models import load_model

    spec = load_model(f"hf:{directory}", meta=True, weights=False)
    return hf_shape(spec.hf.config), sum(p.numel() for p in nn.ModuleList(spec.blocks).parameters())


def differences(shape: dict, ours: dict, theirs: dict) -> list[str]:
    """Each key of `shape` on which brigade's or torchtitan's model is not `shape`, said in words."""
    return [f"{key} {ours[key]} (brigade) vs {theirs[key]} (torchtitan), wanted {want}"
            for key, want in shape.items() if not ours[key] == theirs[key] == want]


def check(directory: Path, steps: int, batch: int) -> list[str]:
    """Write DIR/config.json from SHAPE and hold both sides to it: the same shape, the same
    parameter count on the meta device, torchtitan accepting the run's command line, its float8
    swap taking the blocks' linear layers. Returns what it found, a line each.

    Raises:
        BrigadeError: not torchtitan 0.3.0, a shape or a count that differs, flags it misreads.
    """
    if titan.installed() != titan.VERSION:
        raise BrigadeError(f"torchtitan {titan.installed() or '(none)'} is installed, the comparison runs "
                           f"torchtitan=={titan.VERSION}: run scripts/gpu-compare.sh, which installs it")
    directory.mkdir(parents=True, exist_ok=True)
    hf_config().save_pretrained(directory)
    ours, ours_n = brigade_model(directory)
    config = titan.model_config()
    theirs, theirs_n = titan.shape(config), titan.count_parameters(config)
    wrong = differences(SHAPE, ours, theirs)
    if wrong:
        raise BrigadeError(f"the two models differ: {'; '.join(wrong)}: fix SHAPE or {directory}/config.json")
    if ours_n != theirs_n:
        raise BrigadeError(f"parameter counts differ on the meta device: brigade {ours_n:,}, torchtitan "
                           f"{theirs_n:,}, from the same shape: one side builds a layer the other does not")
    s = SHAPE
    lines = [f"the model: torchtitan's Llama 3 {titan.FLAVOR!r} = {directory}/config.json: dim {s['dim']}, "
             f"{s['n_layers']} layers, {s['n_heads']} heads ({s['n_kv_heads']} key/value), "
             f"ffn {s['ffn_dim']}, vocab {s['vocab_size']}, tied, "
             f"rope {s['rope_theta']:g} ({s['rope_scaling']} x{s['rope_factor']:g})",
             f"parameters on the meta device: brigade {ours_n:,}, torchtitan {titan.VERSION} "
             f"{theirs_n:,}: the same"]
    if titan.stood_in():
        lines.append(f"(triton is not installed: torchtitan's {titan.MOE_KERNELS}, kernels of "
                     "expert-parallel mixture-of-experts runs that a dense Llama never calls, was stood in "
                     "for to import its model code)")
    return lines + [titan_accepts(steps, batch, directory), float8_layers()]


def titan_accepts(steps: int, batch: int, directory: Path) -> str:
    """torchtitan's command line parsed as the run gives it, its settings read back (bf16: the
    float8 run's configuration swaps its layers as it is made, which wants a float8 GPU).

    Raises:
        BrigadeError: torchtitan reads the run's flags as something else.
    """
    config = titan.parse("bf16", titan.flags(steps, batch, str(directory), "TEXT", "DUMP"))
    got = (config.training.steps, config.training.local_batch_size, config.training.seq_len,
           config.compile.enable, config.activation_checkpoint)
    if got != (steps, batch, titan.SEQ_LEN, True, None):
        raise BrigadeError(f"torchtitan reads the run's command line as steps, batch, sequence, compile, "
                           f"recompute = {got}: brigade/results/titan.py does not say what it means")
    return (f"torchtitan takes the run's command line: {steps} steps of {batch} x {titan.SEQ_LEN} tokens, "
            "compiled, no recompute")


def float8_layers() -> str:
    """Which layers torchtitan's float8 swap takes, built emulated (the GPU run is not).

    Raises:
        BrigadeError: it takes the head, or not the five linear layers of every block.
    """
    try:
        import torchao  # noqa: F401  -- torchtitan's float8 and brigade's both need it
    except ImportError:
        return "float8 not checked: torchao is not installed (brigade's float8 extra)"
    names = titan.swapped(titan.model_config(float8=True, emulate=True))
    kept = [n for n in names if any(k in n for k in titan.KEPT)]
    if kept or len(names) != 5 * SHAPE["n_layers"]:
        raise BrigadeError(f"torchtitan's float8 swaps {len(names)} layers ({kept or 'not the head'}); "
                           "expected the 5 linear layers of each block (fused qkv, wo, w1, w2, w3) alone")
    return (f"float8 ({titan.RECIPE}): torchtitan swaps the {len(names)} linear layers of the blocks "
            "(5 each) and keeps the head")


def write_model(directory: Path, shape: dict = SHAPE, device: str = "cuda") -> Path:
    """DIR as save_pretrained writes it: config.json from `shape`, random fp32 weights (drawn on
    `device`: a 1 B model in seconds on a GPU; fp32 because the directory's dtype is the one brigade
    builds its masters in) and a byte-level tokenizer, which torchtitan reads too."""
    import torch

    from brigade.models.hf.deps import require
    from brigade.models.hf.tiny import tokenizer

    transformers = require("transformers")
    tok = tokenizer(TOKENIZER_VOCAB)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(shape, tok.token_to_id(EOT)))
    model.save_pretrained(directory)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT)
    fast.save_pretrained(directory)
    return directory


def write_text(directory: Path) -> Path:
    """TEXT/train.jsonl: CPython's pydoc topics (brigade's built-in corpus, on every machine) as JSON
    Lines, which both read (brigade's --data, torchtitan's --dataloader.dataset_path). torchtitan
    masks attention at each document's end, brigade does not: documents of DOCUMENT_CHARS
    characters (32 sequences and more) keep that from changing the work of more than a few."""
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in sorted(topics))
    directory.mkdir(parents=True, exist_ok=True)
    docs = [json.dumps({"text": text[i:i + DOCUMENT_CHARS]}) for i in range(0, len(text), DOCUMENT_CHARS)]
    (directory / "train.jsonl").write_text("\n".join(docs) + "\n", encoding="utf-8")
    return directory / "train.jsonl"
