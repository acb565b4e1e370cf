"""hf:DIR as blocks: logits equal transformers' for every supported family; blocks built without
memory are filled one by one, a rank reading only its own blocks' tensors; the standalone cut
(bench, tune, plan) computes the same; bad directories get one line each."""

from __future__ import annotations

import json

import pytest
import torch

from brigade.errors import BrigadeError
from brigade.models import load_model
from brigade.models.hf import tiny
from brigade.models.hf.weights import Checkpoint
from brigade.pipeline.stages.side_inputs import whole
from tests.models.hf.dirs import hf, tiny_dir

transformers = pytest.importorskip("transformers")
CASES = [("llama", {}), ("llama", {"tie": False}), ("mistral", {"sliding_window": 5}), ("qwen2", {}),
         ("qwen3", {}), ("gpt2", {}), ("gpt2", {"tie": False}), ("qwen3_moe", {}), ("mixtral", {}),
         ("olmoe", {}), ("qwen3_moe", {"norm_topk_prob": True, "mlp_only_layers": (1,)})]


def _original(directory: str):
    return transformers.AutoModelForCausalLM.from_pretrained(directory).eval()


@pytest.mark.parametrize("family,extra", CASES, ids=[f"{f}-{sorted(e)}" for f, e in CASES])
def test_logits_equal_transformers(family, extra):
    spec = load_model(hf(family, **extra), block_size=16)
    ids = torch.randint(spec.hf.config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = whole(spec.blocks).eval()(spec.text_inputs(ids))
        theirs = _original(tiny_dir(family, **extra))(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert len(spec.blocks) == 2 + 4 and ours.abs().max() > 0.01  # embedding, 4 layers, head; not zeros


def test_a_mixture_is_brigades_layer_with_transformers_names_and_one_tensor_per_expert_on_disk():
    """Qwen3-MoE with layer 1 dense (`mlp_only_layers`): the others' feed-forwards are brigade's
    MoE (what --ep splits), named in memory as transformers names them, on disk expert by expert."""
    from brigade.models.hf.blocks import Stacked
    from brigade.models.moe import MoE

    spec = load_model(hf("qwen3_moe", mlp_only_layers=(1,)), meta=True)
    kinds = [type(b.layer.mlp).__name__ for b in spec.blocks[1:-1]]
    assert kinds == ["MoE", "Qwen3MoeMLP", "MoE", "MoE"]
    layer = spec.blocks[1]
    assert isinstance(layer.layer.mlp, MoE) and layer.layer.mlp.cfg.top_k == 2
    assert layer.memory_names()["layer.mlp.experts.gate_up_proj"] == "model.layers.0.mlp.experts.gate_up_proj"
    stacked = layer.hf_names()["layer.mlp.experts.gate_up_proj"]
    assert isinstance(stacked, Stacked) and len(stacked.parts) == 4
    assert stacked.parts[3] == ("model.layers.0.mlp.experts.3.gate_proj.weight",
                                "model.layers.0.mlp.experts.3.up_proj.weight")
    mixtral = load_model(hf("mixtral"), meta=True).blocks[1].hf_names()
    assert mixtral["layer.mlp.gate.weight"] == "model.layers.0.block_sparse_moe.gate.weight"
    down = mixtral["layer.mlp.experts.down_proj"]
    assert down.parts[0] == ("model.layers.0.block_sparse_moe.experts.0.w2.weight",)


def test_a_mixture_runs_whole_under_tp_and_olmoe_whose_norms_span_heads_has_no_plan():
    plan = load_model(hf("qwen3_moe"), meta=True).blocks[1].tp_plan
    assert plan["layer.mlp"] == "whole" and "layer.mlp.gate_proj" not in plan
    assert load_model(hf("olmoe"), meta=True).blocks[1].tp_plan is None  # --tp refuses it, one line


def test_meta_blocks_start_their_balancing_bias_at_zero():
    """A buffer no checkpoint holds (the router's balancing bias) is zero, not whatever memory held."""
    spec = load_model(hf("qwen3_moe"), meta=True)
    spec.hf.load(dict(enumerate(spec.blocks)), "cpu")
    assert all(not b.layer.mlp.bias.any() for b in spec.blocks[1:-1])


def test_a_sliding_window_is_applied():
    """A window of 5 over 16 tokens changes the logits: the mask the blocks build reads it."""
    ids = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(1))
    windowed = load_model(hf("mistral", sliding_window=5), block_size=16)
    full = load_model(hf("mistral", sliding_window=5), block_size=16)
    for block in full.blocks[1:-1]:
        block.window = None
    with torch.no_grad():
        a, b = (whole(s.blocks).eval()(s.text_inputs(ids)) for s in (windowed, full))
    assert (a - b)[:, 5:].abs().max() > 1e-4 and torch.equal(a[:, :5], b[:, :5])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_standalone_blocks_compute_the_same_without_side_inputs(family):
    ids = torch.randint(256, (2, 12), generator=torch.Generator().manual_seed(2))
    spec, alone = load_model(hf(family)), load_model(hf(family), standalone=True)
    with torch.no_grad():
        ours = whole(spec.blocks).eval()(spec.text_inputs(ids))
        theirs = torch.nn.Sequential(*alone.blocks).eval()(ids)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    assert alone.text_inputs is None and torch.is_tensor(alone.make_batch(2, torch.Generator())[0])


def test_meta_blocks_read_only_their_own_tensors(monkeypatch):
    """A rank holding blocks 2 and 3 reads their tensors, no others; the rest stay without memory."""
    spec = load_model(hf("llama"), meta=True)
    assert all(p.is_meta for b in spec.blocks for p in b.parameters())
    read = []
    real_read = Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read", lambda self, name, index=None: read.append(name)
                        or real_read(self, name, index))
    spec.hf.load({2: spec.blocks[2], 3: spec.blocks[3]}, "cpu")
    assert sorted({n.split(".")[2] for n in read}) == ["1", "2"]
    assert all(n.startswith("model.layers.") for n in read)
    assert not any(p.is_meta for b in spec.blocks[2:4] for p in b.parameters())
    assert all(p.is_meta for b in (spec.blocks[0], spec.blocks[1], spec.blocks[-1]) for p in b.parameters())
    whole_model = load_model(hf("llama"))
    torch.testing.assert_close(spec.blocks[2].state_dict(), whole_model.blocks[2].state_dict())


def test_a_bf16_directory_trains_fp32_master_weights(tmp_path):
    """config.json naming bfloat16 (as every published checkpoint does) and bf16 weights: the
    blocks are fp32 all the same (the master weights; --precision chooses what runs in bf16),
    holding the bf16 values exactly."""
    import shutil
    from pathlib import Path

    src = Path(hf("llama")[3:])
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, tmp_path / name)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(torch_dtype="bfloat16", dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = transformers.AutoModelForCausalLM.from_pretrained(src).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    spec = load_model(f"hf:{tmp_path}")
    assert {p.dtype for b in spec.blocks for p in b.parameters()} == {torch.float32}
    theirs = model.model.layers[0].mlp.up_proj.weight
    assert torch.equal(spec.blocks[1].layer.mlp.up_proj.weight, theirs.float())


def test_a_tie_held_by_one_rank_stays_one_parameter():
    spec = load_model(hf("llama"), meta=True)
    spec.hf.load(dict(enumerate(spec.blocks)), "cpu")
    assert spec.blocks[-1].lm_head.weight is spec.blocks[0].embed_tokens.weight
    untied = load_model(hf("llama", tie=False))
    assert untied.blocks[-1].lm_head.weight is not untied.blocks[0].embed_tokens.weight


def _copy(tmp_path, family="llama"):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(tiny_dir(family), out)
    return out


def _rewrite_weights(directory, change):
    from safetensors.torch import load_file, save_file

    state = load_file(str(directory / "model.safetensors"))
    change(state)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _edit_config(directory, **fields):
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


BAD = {
    "no directory": (lambda d: d / "nowhere", "no such directory"),
    "no config": (lambda d: (d / "config.json").unlink() or d, "has no config.json"),
    "no weights": (lambda d: (d / "model.safetensors").unlink() or d, "has no weights"),
    "missing tensor": (lambda d: _rewrite_weights(d, lambda s: s.pop("model.layers.2.mlp.up_proj.weight"))
                       or d, "no tensor 'model.layers.2.mlp.up_proj.weight'"),
    "shape mismatch": (lambda d: _rewrite_weights(d, lambda s: s.update(
        {"model.norm.weight": torch.ones(31)})) or d, r"'model.norm.weight' is stored with shape \[31\]"),
    "unsupported family": (lambda d: _edit_config(d, model_type="bert") or d,
                           "model_type 'bert' is not a family"),
    "refused field": (lambda d: _edit_config(d, attention_chunk_size=8) or d, "sets attention_chunk_size"),
    "heads do not divide": (lambda d: _edit_config(d, num_attention_heads=5) or d,
                            "5 attention heads do not divide the hidden size 32"),
    "kv heads do not divide": (lambda d: _edit_config(d, num_key_value_heads=3) or d,
                               "3 key/value heads do not divide the 4 attention heads"),
    "missing expert": (lambda d: _rewrite_weights(d, lambda s: s.pop(
        "model.layers.1.mlp.experts.3.up_proj.weight")) or d,
        "no tensor 'model.layers.1.mlp.experts.3.up_proj.weight'", "qwen3_moe"),
    "misshaped expert": (lambda d: _rewrite_weights(d, lambda s: s.update(
        {"model.layers.0.mlp.experts.2.down_proj.weight": torch.ones(32, 8)})) or d,
        r"'model.layers.0.mlp.experts.2.down_proj.weight' is stored with shape \[32, 8\] but config.json "
        r"makes it \[32, 16\]", "qwen3_moe"),
    "experts of another count": (lambda d: _edit_config(d, num_experts=8, num_local_experts=8) or d,
                                 r"tensor 'model.layers.0.mlp.gate.weight' is stored with shape \[4, 32\] "
                                 r"but config.json makes it \[8, 32\]", "qwen3_moe"),
    "truncated weights": (lambda d: _truncate(d / "model.safetensors") or d,
                          r"model.safetensors \(0.0 GB\) is not a whole safetensors file \(.*\): a "
                          "download cut short"),
}


def _truncate(path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("case", BAD)
def test_bad_directories_get_one_line(tmp_path, case):
    make, message, *family = BAD[case]
    directory = make(_copy(tmp_path, *family))
    with pytest.raises(BrigadeError, match=message) as info:
        load_model(f"hf:{directory}")
    assert "\n" not in str(info.value)


def test_a_weight_file_too_large_to_map_is_one_line(tmp_path, monkeypatch):
    """What safetensors raises for a 141 GB model.safetensors on a machine that cannot map it (the
    message is the one it gave here for a sparse file of that size)."""
    import safetensors

    def refuse(path, framework):
        raise RuntimeError(f"unable to mmap 151397597304 bytes from file <{path}>: "
                           "Cannot allocate memory (12)")

    monkeypatch.setattr(safetensors, "safe_open", refuse)
    with pytest.raises(BrigadeError, match=r"model.safetensors \(0.0 GB\) cannot be mapped into memory "
                                           r"\(.*\): .* max_shard_size='5GB'") as info:
        load_model(f"hf:{_copy(tmp_path)}")
    assert "\n" not in str(info.value)


def test_without_the_extra_hf_says_how_to_install(monkeypatch):
    import sys

    name = hf("llama")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers: ImportError
    with pytest.raises(BrigadeError, match=r"needs the package 'transformers'.*pip install -e '\.\[hf\]'"):
        load_model(name)
    assert load_model("toy").blocks  # brigade without it still works


def test_the_tiny_directory_loads_in_transformers_with_its_tokenizer(tmp_path):
    out = tiny.write(tmp_path / "t", "qwen2", layers=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert model.config.num_hidden_layers == 2 and tok("def f():").input_ids
