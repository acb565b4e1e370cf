"""The planner and a mixture of experts (`planner.mixture`, `planner.expert_parallel`): ep among the
layouts only where the experts divide, each process's experts 1/ep of them (1/dp sharded), the
FLOPs of the top-k experts a token reaches, total against active parameters, the all-to-alls'
time, the experts' gradients reduced over edp, and a bad --ep one line."""

import json

import pytest
import torch

from brigade.models import load_model
from brigade.models.gpt import GPTConfig
from brigade.planner import comm
from brigade.planner.cluster import Cluster
from brigade.planner.costs import ModeCosts, ModelCosts, _flops_and_outputs
from brigade.planner.devices import TABLE
from brigade.planner.formula import from_shapes
from brigade.planner.memory import rank_memory
from brigade.planner.mixture import Mixture, mixture
from brigade.planner.predict import predict
from brigade.planner.reduction import exposed
from brigade.planner.space import Layout, enumerate_layouts
from brigade.results.moe_plan import QWEN3_30B_A3B

T, C, E, K = 32, 64, 8, 2  # the tiny GPTs' sequence, width, experts and top-k
DENSE = GPTConfig(vocab_size=96, block_size=T, n_layer=2, n_head=2, n_embd=C)
MOE = GPTConfig(vocab_size=96, block_size=T, n_layer=2, n_head=2, n_embd=C, experts=E, top_k=K)


def _spec(cfg: GPTConfig, meta: bool = False):
    with torch.device("meta" if meta else "cpu"):
        return load_model("gpt", seed=0, gpt_cfg=cfg)


def test_ep_is_in_the_space_only_for_experts_and_only_where_it_divides_them_and_dp():
    def pairs(experts):
        rows = enumerate_layouts(4, 4, 16, ["none"], ["1f1b"], [1], experts=experts)
        return {(r.dp, r.ep) for r in rows}

    assert pairs((8, 8)) == {(4, 1), (4, 2), (4, 4), (2, 1), (2, 2), (1, 1)}
    assert pairs((6, 8)) == {(4, 1), (4, 2), (2, 1), (2, 2), (1, 1)}  # 4 does not divide 6
    assert pairs(()) == {(4, 1), (2, 1), (1, 1)}  # a dense model: ep 1 alone
    assert Layout(1, 4, 1, "1f1b", 1, 2, "none", ep=2).label() == "shard 4, ep 2, m 2"
    assert Layout(1, 4, 1, "1f1b", 1, 2, "none", ep=2).degrees.group("ep", 0) == [0, 1]


def _costs() -> ModelCosts:
    """Two blocks, each a 100-byte dense weight and an 800-byte one of its 8 experts."""
    mode = ModeCosts({1: [(1.0, 2.0, 1.0, 1.0)] * 2}, held=[10.0] * 2, working=[0.0] * 2,
                     transient=[1.0] * 2, kept=[0.0] * 2)
    mix = Mixture((frozenset({2}), frozenset({4})), (E, E), (1, 1), (1000.0, 1000.0), 450, 150)
    return ModelCosts("m", [{1: 100, 2: 800}, {3: 100, 4: 800}], [1.0] * 2, [4.0] * 2, {"none": mode}, 0.0,
                      TABLE["h100"], mixture=mix)


@pytest.mark.parametrize("replicate, shard, ep, params", [
    (4, 1, 1, 1800),  # DDP: everything whole
    (4, 1, 2, 200 + 1600 / 2),  # the experts ÷ ep
    (4, 1, 4, 200 + 1600 / 4),
    (1, 4, 1, 1800 / 4),  # sharded at ep 1: the experts are dense weights like the rest
    (1, 4, 2, 200 / 4 + 1600 / 4),  # sharded: the experts ÷ ep ÷ edp = ÷ dp
    (2, 2, 2, 200 / 2 + 1600 / 4),  # HSDP: the dense ÷ shard, the experts still ÷ dp
    (2, 2, 1, 1800 / 2),
])
def test_each_process_holds_its_share_of_the_experts(replicate, shard, ep, params):
    lay = Layout(replicate, shard, 1, "1f1b", 1, 1, "none", ep=ep)
    got = rank_memory(_costs(), lay, [2], {0: 1}, mb=1, pp_rank=0)
    assert got["params"] == pytest.approx(params) and got["grads"] == got["params"]
    assert got["optimizer"] == pytest.approx(2 * params)


def test_ddps_buckets_leave_the_experts_out_and_their_flat_copy_is_counted_after_the_backward():
    """DDP at ep 2: the reducer's buckets hold the dense 200 bytes, not the experts' 800; the
    experts' gradients are copied flat once the backward is over, beside every gradient (the
    moment measured as the step's peak at ep 2 of dp 4, `results/experts`)."""
    one = rank_memory(_costs(), Layout(4, 1, 1, "1f1b", 1, 1, "none"), [2], {0: 1}, mb=1, pp_rank=0)
    two = rank_memory(_costs(), Layout(4, 1, 1, "1f1b", 1, 1, "none", ep=2), [2], {0: 1}, mb=1, pp_rank=0)
    assert two["params"] == 1000  # 200 dense + 800 of the experts
    # params and AdamW 3 × 1000, the dense buckets 200, then the larger phase: the flat copy
    # (800) beside the gradients (1000), more than the backward's gradients and 20 activations
    assert two["peak"] == 3 * 1000 + 200 + 1000 + 800
    assert one["peak"] == 3 * 1800 + 1800 + 1800 + 20 + 1  # ep 1: every weight in the buckets


def test_flops_count_the_top_k_experts_each_token_reaches_from_shapes_and_measured():
    # per token, the experts' SwiGLU (3 matmuls C × 2C, k of them) against the dense MLP's (2 of C ×
    # 4C), and the router's C × E; backward twice the forward
    extra = 3 * T * (K * 3 * 2 * C * 2 * C - 2 * 2 * C * 4 * C + 2 * C * E)
    shapes = [from_shapes(_spec(cfg, meta=True), 2, ["none"], TABLE["h100"]).flops for cfg in (DENSE, MOE)]
    assert shapes[1][1] - shapes[0][1] == pytest.approx(extra)
    measured = []
    for cfg in (DENSE, MOE):
        spec = _spec(cfg)
        x, y = spec.make_batch(2, torch.Generator().manual_seed(0))
        measured.append(_flops_and_outputs(spec, x, y)[0])
    assert measured[1][1] - measured[0][1] == pytest.approx(extra)  # the router's real choices: same count


def test_active_parameters_are_the_dense_ones_and_top_k_of_each_layers_experts():
    spec = _spec(MOE, meta=True)
    mix = mixture(spec.blocks, T)
    total = sum(p.numel() for p in {id(p): p for b in spec.blocks for p in b.parameters()}.values())
    experts = MOE.n_layer * E * 3 * C * 2 * C  # gate, up and down of width 2C, each layer
    assert mix.total == total
    assert mix.active == pytest.approx(total - experts * (1 - K / E)) and mix.active < mix.total
    assert mix.counts == (E, E) and mix.layers == (0, 1, 1, 0) and mix.rows[1] == T * K * C
    assert mixture(_spec(DENSE, meta=True).blocks, T) is None


def test_an_all_to_all_sends_each_peers_share_on_its_own_link():
    h100 = TABLE["h100"]
    two = Cluster(2, 2, h100)
    # from rank 0: rank 1 on its node, ranks 2 and 3 across; 100 bytes to each
    assert comm.all_to_all(two, [0, 1, 2, 3], 400) == pytest.approx(
        max(100 / h100.intra_bw, 200 / h100.inter_bw) + 3 * h100.inter_latency)
    assert comm.all_to_all(two, [0, 1], 400) == pytest.approx(200 / h100.intra_bw + h100.intra_latency)
    assert comm.all_to_all(two, [0], 400) == 0.0


@pytest.mark.parametrize("recompute, rows, counts", [("none", 4, 1), ("full", 6, 2)])
def test_the_all_to_alls_are_on_the_critical_path_under_ep_and_none_at_ep_1(recompute, rows, counts):
    costs = from_shapes(_spec(MOE, meta=True), 2, [recompute], TABLE["h100"])
    where = Cluster(1, 4, TABLE["h100"])
    one, two = (predict(costs, Layout(4, 1, 1, "1f1b", 1, 2, recompute, ep=ep), where, 16, T)
                for ep in (1, 2))
    assert one["all_to_all_s"] == 0.0
    each = comm.all_to_all(where, [0, 1], T * K * C * 2 * 4)  # 2 samples a micro-batch, fp32 rows
    count = comm.all_to_all(where, [0, 1], E * 8)
    # 2 micro-batches × 2 MoE layers × (2 there and back in the forward, 2 in the backward, 2
    # again where the forward runs again; the counts' once a forward)
    assert two["all_to_all_s"] == pytest.approx(2 * 2 * (rows * each + counts * count))
    assert two["pipeline_s"] - one["pipeline_s"] == pytest.approx(two["all_to_all_s"])


def test_the_experts_gradients_are_reduced_over_the_processes_holding_the_same_experts():
    where = Cluster(1, 4, TABLE["h100"])
    link = comm.link(where, [0, 1, 2, 3], "all_reduce")

    def dense(nbytes: float, ep: int) -> float:  # DDP's all-reduce, beside the backward on a GPU
        row = predict(_costs(), Layout(4, 1, 1, "1f1b", 1, 1, "none", ep=ep), where, 4, 1)
        return exposed(comm.all_reduce(nbytes, 4, *link), row["pipeline_s"], _costs().n_blocks + 1)

    def reduce_s(ep: int) -> float:
        return predict(_costs(), Layout(4, 1, 1, "1f1b", 1, 1, "none", ep=ep), where, 4, 1)["reduce_s"]

    assert reduce_s(1) == pytest.approx(dense(1800, 1))
    # the dense 200 bytes over dp 4, the experts' 1600 / ep over edp = 4 / ep (by hand, after the
    # backward: not overlapped)
    assert reduce_s(2) == pytest.approx(dense(200, 2) + comm.all_reduce(800, 2, *link))
    assert reduce_s(4) == pytest.approx(dense(200, 4))  # one process a set of experts


BAD = [
    (["--experts", "8", "--ep", "3"], "--ep 3 does not divide the 8 experts of an MoE layer"),
    (["--ep", "2"], "--ep 2 but gpt has no mixture-of-experts layer"),
    (["--experts", "8", "--ep", "4", "--pp", "2"], "--ep 4 does not divide the data-parallel ranks (2)"),
    (["--experts", "8", "--ep", "4", "--dp", "2"], "--ep 4 does not divide the data-parallel ranks (2)"),
]


@pytest.mark.parametrize("args, words", BAD)
def test_a_bad_ep_is_one_line(cli, args, words):
    done = cli("plan", "--model", "gpt", "--n-layer", "2", "--n-embd", "32", "--n-head", "2",
               "--seq-len", "16", "--batch-size", "8", "--gpus-per-node", "4", "--device", "h100", *args)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert words in done.stderr, done.stderr


# Qwen3-30B-A3B's config.json (the results script's) at a tiny size: the same family and fields
TINY_QWEN3_MOE = {**QWEN3_30B_A3B, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
                  "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                  "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 64,
                  "max_position_embeddings": 128, "rope_theta": 10000.0}


def test_a_config_only_mixture_plans_with_ep_and_writes_it_in_the_config(cli, tmp_path):
    pytest.importorskip("transformers", reason="the hf extra (scripts/setup.sh installs it)")
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN3_MOE))
    args = ["plan", "--model", f"hf:{tmp_path}", "--gpus-per-node", "4", "--device", "h100",
            "--batch-size", "8", "--seq-len", "16", "--pp", "1", "--precision", "bf16"]
    done = cli(*args, "--json", "--write-config", str(tmp_path / "best.toml"))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert {r["layout"]["ep"] for r in result["rows"]} == {1, 2, 4}
    p = result["parameters"]
    assert p["experts"] == [4] and p["top_k"] == [2] and p["moe_layers"] == 2
    assert p["total"] - p["active"] == 2 * 4 * 3 * 32 * 16 / 2  # half of each layer's experts idle
    fit = next(r for r in result["rows"] if r["fits"])
    assert f"ep = {fit['layout']['ep']}" in (tmp_path / "best.toml").read_text()
    text = cli(*args, "--top", "3")
    assert text.returncode == 0
    assert "active a token (FLOPs): top 2 of 4 experts in 2 MoE layers" in text.stdout
