"""`brigade export --hf OUT --adapter --from RUN`: a LoRA run's adapters as a PEFT adapter folder.

The folder is what `peft.PeftModel.from_pretrained(base, OUT)` reads onto the run's own hf:DIR
model (`peft` itself is not needed to write it):

    adapter_config.json        peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, lora_dropout,
                               target_modules (the adapted layers' full module names in the
                               directory's model), base_model_name_or_path (the run's hf:DIR)
    adapter_model.safetensors  for each adapted layer M (a name like model.layers.0.self_attn.q_proj)
                               base_model.model.M.lora_A.weight  (r, in)   brigade's lora_a
                               base_model.model.M.lora_B.weight  (out, r)  brigade's lora_b

in the dtype the directory's config.json names. PEFT computes the same update as brigade,
x Aᵀ Bᵀ · alpha / r (without rsLoRA), so the adapted model's logits are the run's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from brigade.models.hf.deps import require
from brigade.parallel.lora import LoraSpec

PREFIX = "base_model.model."  # where PEFT's wrapper keeps the model it adapts


def adapter_state(blocks: list[nn.Module], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """{PEFT key: tensor} of every adapted layer of `blocks` (whole, one process)."""
    out: dict[str, torch.Tensor] = {}
    for block in blocks:
        names = block.hf_names()
        for name, module in block.named_modules():
            if isinstance(module, nn.Linear) and hasattr(module, "lora_a"):
                theirs = PREFIX + names[f"{name}.weight"].removesuffix(".weight")
                out[f"{theirs}.lora_A.weight"] = module.lora_a.detach().to(dtype).contiguous()
                out[f"{theirs}.lora_B.weight"] = module.lora_b.detach().to(dtype).contiguous()
    return out


def adapter_config(adapters: LoraSpec, modules: list[str], base: Path) -> dict:
    """The adapter_config.json PEFT reads for `adapters` on the layers `modules`."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
            "r": adapters.rank, "lora_alpha": adapters.alpha, "lora_dropout": adapters.dropout,
            "target_modules": sorted(modules), "bias": "none", "fan_in_fan_out": False,
            "inference_mode": True, "use_rslora": False, "modules_to_save": None}


def write_adapter(blocks: list[nn.Module], hf, adapters: LoraSpec, folder: Path, dtype: torch.dtype) -> None:
    """The adapter folder of a LoRA run's trained `blocks` (its hf:DIR `hf`) into `folder`."""
    safetensors = require("safetensors.torch")
    state = adapter_state(blocks, dtype)
    modules = sorted({k.removeprefix(PREFIX).rsplit(".lora_", 1)[0] for k in state})
    (folder / "adapter_config.json").write_text(
        json.dumps(adapter_config(adapters, modules, hf.directory), indent=2) + "\n")
    safetensors.save_file(state, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
