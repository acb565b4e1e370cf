"""`brigade plan` and tensor parallel (brigade/planner/tensor.py and its uses): what a tp split does
to each block, the tp layouts of the space, their memory and time, and the refusals."""

import pytest
import torch

from brigade.errors import BrigadeError
from brigade.models.gpt import GPTConfig, gpt
from brigade.models.toy import mlp
from brigade.planner import comm
from brigade.planner.space import Layout, enumerate_layouts
from brigade.planner.tensor import TensorFacts, facts


def _gpt_facts(n_head: int = 4) -> TensorFacts:
    with torch.device("meta"):
        return facts(gpt(GPTConfig(n_layer=2, n_head=n_head, n_embd=64)))


def test_a_gpt_blocks_matmuls_split_and_its_embedding_and_head_stay_whole():
    f = _gpt_facts()
    assert f.split[0] == 0.0 and f.split[-1] == 0.0
    # A block's parameters outside the split: two LayerNorms (4 × 64) and the two row-wise biases (2 × 64).
    whole = 12 * 64 * 64 + 13 * 64  # qkv, proj, up, down weights and every bias and norm
    assert f.split[1] == pytest.approx(1 - 6 * 64 / whole)
    assert f.pairs == (0, 2, 2, 0) and f.sizes == (1, 2, 4)  # 4 heads: tp 8 does not divide them
    assert f.factor(1, 2) == pytest.approx(1 - f.split[1] / 2) and f.factor(0, 2) == 1.0
    assert f.factor(1, 1) == 1.0


def test_sequence_parallel_blocks_name_their_norms_and_gathered_copies():
    f = _gpt_facts()
    assert f.normed == (0, 2, 2, 0) and f.gathered == (0, 2, 2, 0)  # attn and mlp gather once each
    assert f.shared == (0, 2, 2, 0)  # both by a "gather" entry: kept as parts without recompute
    assert [f.sequence(b) for b in range(4)] == [False, True, True, False]
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "examples" / "llama.py"
    spec = importlib.util.spec_from_file_location("llama_example", path)
    llama = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(llama)
    with torch.device("meta"):
        g = facts(llama.model(n_layer=1))
    assert g.normed == (0, 2, 0) and g.gathered == (0, 4, 0)  # q, kv, gate, up each gather their own
    assert g.shared == (0, 0, 0)  # no "gather" entry: all four stay whole copies


def test_held_activations_under_sequence_parallel():
    """A sequence-parallel block holds 1/tp of what one device holds, but for the whole copies its
    matmuls gather in place of its norms' outputs, which without recompute are parts where a
    "gather" entry makes them; full recompute holds its input's part."""
    from brigade.planner.costs import ModeCosts, ModelCosts

    f = _gpt_facts()
    def mode(held: list[float]) -> ModeCosts:
        return ModeCosts(times={}, held=held, working=[0.0] * 4, transient=[0.0] * 4, kept=[0.0] * 4)

    modes = {"none": mode([10.0, 100.0, 100.0, 5.0]), "full": mode([10.0, 8.0, 8.0, 5.0]),
             "selective": mode([10.0, 100.0, 100.0, 5.0])}
    c = ModelCosts("gpt", [{}] * 4, [0.0] * 4, [8.0] * 4, modes, 0.0, None, tensor=f)
    assert c.held("none", 1, 1) == 100.0 and c.held("none", 0, 2) == 10.0  # tp 1; a whole block
    assert c.held("none", 1, 2) == pytest.approx((100 - 2 * 8) / 2 + 2 * 8 / 2)  # parts: 100 / 2
    assert c.held("selective", 1, 2) == pytest.approx((100 - 2 * 8) / 2 + 2 * 8)  # whole copies
    assert c.held("full", 1, 2) == 4.0 and c.part(1, 2) == 0.5 and c.part(0, 2) == 1.0


def test_an_untied_head_splits_its_vocabulary_and_what_comes_of_its_logits():
    """An untied GPT head (vocabulary 96, width 64): its weight splits, its norm takes part in
    sequence parallel; one tp process holds its logits' share beside the whole gathered copy of
    its input, and the working set and temporaries not measured at that degree shrink with it.
    At a degree the vocabulary does not divide the head stays whole."""
    from brigade.planner.costs import ModeCosts, ModelCosts

    with torch.device("meta"):
        f = facts(gpt(GPTConfig(n_layer=2, n_head=4, n_embd=64, tie_embeddings=False)))
    assert f.vocab == (0, 0, 0, 96) and f.normed[-1] == 1 and f.gathered[-1] == 1
    assert f.split[-1] == pytest.approx(96 * 64 / (96 * 64 + 2 * 64))  # the norm's weight and bias whole
    assert f.splits_vocab(3, 2) and f.sequence(3, 2) and f.factor(3, 2) < 0.6
    assert not f.splits_vocab(3, 64) and not f.sequence(3, 64) and f.factor(3, 64) == 1.0  # 96 % 64
    with torch.device("meta"):
        assert _gpt_facts().vocab == (0, 0, 0, 0)  # tied: whole, as its embedding is

    def mode(held: list[float], working: list[float]) -> ModeCosts:
        return ModeCosts(times={}, held=held, working=working, transient=[0.0] * 4, kept=[0.0] * 4)

    modes = {"none": mode([10.0, 100.0, 100.0, 400.0], [0.0] * 4),
             "full": mode([10.0, 8.0, 8.0, 8.0], [0.0, 92.0, 92.0, 392.0])}
    out = [8.0, 8.0, 8.0, 384.0]  # per sample: the hidden states, then the logits
    c = ModelCosts("gpt", [{}] * 4, [0.0] * 4, out, modes, 0.0, None, tensor=f)
    assert c.held("none", 3, 2) == pytest.approx((400 - 8) / 2 + 8)  # the input's whole copy, not the logits'
    assert c.held("full", 3, 2) == 4.0
    assert c.working("full", 3, 2) == pytest.approx(392 * c.held("none", 3, 2) / 400)
    assert c.working("full", 3, 64) == 392.0 and c.working("full", 3, 1) == 392.0  # whole
    from brigade.planner.memory import block_transient

    c.modes["full"].transient = [0.0, 16.0, 16.0, 768.0]  # from shapes: an output and its gradient
    at = {tp: block_transient(c, Layout(1, 1, 1, "1f1b", 1, 1, "full", tp=tp), [3], 1.0, False)
          for tp in (1, 2)}
    assert at == {1: 768.0, 2: 384.0}


def test_a_model_without_plans_allows_no_tp():
    assert facts(mlp(8, 2)).sizes == (1,)


def test_tp_layouts_are_innermost_and_divide_a_nodes_devices():
    rows = enumerate_layouts(8, 6, 16, ["none"], ["1f1b"], [2], tp_sizes=(1, 2, 4, 8), per_node=4)
    assert {r.tp for r in rows} == {1, 2, 4}  # tp 8 would leave the node
    assert all(r.world == 8 for r in rows)
    row = Layout(2, 1, 2, "1f1b", 1, 2, "none", tp=2)
    assert row in rows and row.label() == "dp 2 × pp 2 1f1b × tp 2, m 2"
    assert Layout(1, 1, 2, "1f1b", 1, 2, "none", tp=4).label() == "pp 2 1f1b × tp 4, m 2"
    assert Layout(2, 1, 1, "1f1b", 1, 1, "none", tp=4).label() == "dp 2 × tp 4, m 1"
    assert Layout(1, 1, 1, "1f1b", 1, 1, "none", tp=8).label() == "dp 1 × tp 8, m 1"


def test_the_tp_group_is_the_innermost_neighbours():
    g = comm.groups(2, 1, 2, tp=4)
    assert g["tp"] == [0, 1, 2, 3] and g["pp"] == [0, 4] and g["dp"] == [0, 8]


def test_plan_ranks_tp_layouts_with_half_the_split_parameters(cli):
    import json

    out = cli("plan", "--model", "gpt", "--n-layer", "4", "--n-embd", "256", "--n-head", "4",
              "--seq-len", "64", "--batch-size", "16", "--gpus-per-node", "4", "--device", "h100",
              "--costs", "formula", "--pp", "1", "--microbatches", "1", "--recompute", "none", "--json")
    assert out.returncode == 0, out.stderr
    rows = {(r["layout"]["tp"], r["layout"]["shard"], r["layout"]["dp"]): r
            for r in json.loads(out.stdout)["rows"]}
    ddp, tp2, tp4 = rows[(1, 1, 4)], rows[(2, 1, 2)], rows[(4, 1, 1)]
    assert tp2["label"] == "dp 2 × tp 2, m 1"
    # The blocks' matmuls halve; the embedding, head and norms (a few % here) stay whole.
    assert tp4["memory"]["params"] < tp2["memory"]["params"] < ddp["memory"]["params"]
    assert ddp["memory"]["params"] / 2 < tp2["memory"]["params"] < 0.55 * ddp["memory"]["params"]
    assert tp2["microbatch_size"] == 2 * ddp["microbatch_size"]  # half the replicas at the same world


@pytest.mark.parametrize("flags, message", [
    (["--tp", "8"], "--tp 8: the model's tensor-parallel plans allow 2, 4; give one of them, or --tp 1"),
    (["--tp", "2", "--model", "mlp"], "--tp 2: the model's tensor-parallel plans allow none: a block has "
                                      "no tp_plan"),
    (["--tp", "4", "--gpus-per-node", "2", "--nodes", "2"], "--tp 4 does not divide a node's 2 devices"),
])
def test_a_tp_the_model_or_the_node_cannot_take_is_one_line(cli, flags, message):
    base = ["plan", "--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--seq-len", "16",
            "--batch-size", "8", "--gpus-per-node", "4", "--device", "h100", "--costs", "formula"]
    out = cli(*base, *flags)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_a_plan_error_is_a_brigade_error():
    from brigade.planner.config import PlanConfig
    from brigade.planner.run import _tp_sizes

    with pytest.raises(BrigadeError):
        _tp_sizes(PlanConfig(tp=3), _gpt_facts(), 4)
