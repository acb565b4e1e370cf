"""The planner and context parallel (`planner.attention`, `planner.context`): cp among the layouts
only where the sequence and (under all-to-all) the heads split, a process holding its part of every
activation, the all-to-alls on the critical path and none at cp 1, the ring counted only where its
compute does not hide it, the reduction over dp × cp, --cp keeping one degree, each bad --cp one
line, and Llama 3.1 8B at 131,072 positions fitting 8 H100s."""

import json

import pytest
import torch

from brigade.models import load_model
from brigade.models.gpt import GPTConfig
from brigade.planner import comm
from brigade.planner.attention import AttentionFacts, Call, observe
from brigade.planner.cluster import Cluster
from brigade.planner.context import exchanges
from brigade.planner.devices import TABLE
from brigade.planner.formula import from_shapes
from brigade.planner.predict import predict
from brigade.planner.reduction import exposed
from brigade.planner.space import Layout, enumerate_layouts

T, C, H = 32, 64, 2  # the tiny GPT's sequence, width and heads (head dim 32)
GPT = GPTConfig(vocab_size=96, block_size=T, n_layer=2, n_head=H, n_embd=C)
H100 = TABLE["h100"]


def _facts(heads: int = 4, kv: int = 4, length: int = 64, masked: bool = False) -> AttentionFacts:
    """One block without attention, then one with a call of these shapes (head dim 16)."""
    return AttentionFacts(((), (Call(heads, kv, length, length, 16, 16, True, masked),)))


def test_the_attention_calls_are_observed_on_the_meta_device():
    with torch.device("meta"):
        spec = load_model("gpt", seed=0, gpt_cfg=GPT)
    seen = observe(spec)
    assert [len(calls) for calls in seen.calls] == [0, 1, 1, 0]  # embedding, 2 blocks, head
    assert seen.calls[1][0] == Call(H, H, T, T, C // H, C // H, True, False)
    with torch.device("meta"):
        assert observe(load_model("mlp", seed=0)) is None  # no attention: cp 1 alone


def test_cp_is_in_the_space_only_where_the_sequence_and_the_heads_split():
    four = _facts()
    assert four.cp_sizes(8, 1, 64, ring=False) == (1, 2, 4)  # all-to-all: 4 heads into 8 groups does not go
    assert four.cp_sizes(8, 1, 64, ring=True) == (1, 2, 4, 8)  # ring: the heads stay whole
    assert four.cp_sizes(8, 2, 64, ring=False) == (1, 2)  # 4 heads ÷ tp 2 into 2 groups, not 4
    assert four.cp_sizes(8, 1, 40, ring=True) == (1, 2, 4)  # 40 does not make 2 × 8 chunks
    assert four.cp_sizes(8, 1, 36, ring=False) == (1, 2, 4)  # a2a: 36 into 4 parts, not 8
    assert four.cp_sizes(8, 1, 64, ring=False, tried=(3,)) == (1,)  # 3 does not divide 8
    assert _facts(masked=True).cp_sizes(8, 1, 64, ring=True) == (1,)  # a mask: the runtime refuses
    rows = enumerate_layouts(8, 4, 16, ["none"], ["1f1b"], [1], cp_sizes={1: (1, 2, 4)})
    assert {(r.dp, r.pp, r.cp) for r in rows} == {(dp, pp, cp) for cp in (1, 2, 4) for pp in (1, 2, 4)
                                                   if 8 // cp % pp == 0 for dp in [8 // (cp * pp)]}
    assert all(r.world == 8 for r in rows)
    assert {r.cp for r in enumerate_layouts(8, 4, 16, ["none"], ["1f1b"], [1])} == {1}  # none given
    moe = enumerate_layouts(4, 4, 16, ["none"], ["1f1b"], [1], experts=(8,), cp_sizes={1: (1, 2)})
    assert {(r.cp, r.ep) for r in moe} == {(1, 1), (1, 2), (1, 4), (2, 1)}  # cp > 1 at ep 1 alone
    assert Layout(1, 2, 1, "1f1b", 1, 1, "none", tp=2, cp=2).label() == "shard 2 × cp 2 × tp 2, m 1"
    assert Layout(1, 1, 2, "1f1b", 1, 4, "none", cp=4).label() == "pp 2 1f1b × cp 4, m 4"


def _costs():
    with torch.device("meta"):
        spec = load_model("gpt", seed=0, gpt_cfg=GPT)
    costs = from_shapes(spec, 2, ["none", "full"], H100)
    costs.attention = observe(spec)
    return costs


def test_a_process_holds_its_part_of_every_activation():
    costs = _costs()
    one = predict(costs, Layout(1, 1, 1, "1f1b", 1, 1, "none"), Cluster(1, 1, H100), 4, T)
    two = predict(costs, Layout(1, 1, 1, "1f1b", 1, 1, "none", cp=2), Cluster(1, 2, H100), 4, T)
    assert two["microbatch_size"] == one["microbatch_size"] == 4  # cp splits sequences, not the batch
    assert two["memory"]["activations"] == pytest.approx(one["memory"]["activations"] / 2)
    assert two["memory"]["params"] == one["memory"]["params"]  # DDP over cp: the weights whole
    # sharded (FSDP2 over shard × cp): the states ÷ 4, the activations still ÷ cp
    four = predict(costs, Layout(1, 2, 1, "1f1b", 1, 1, "none", cp=2), Cluster(1, 4, H100), 8, T)
    assert four["memory"]["params"] == pytest.approx(one["memory"]["params"] / 4)
    assert four["memory"]["activations"] == pytest.approx(one["memory"]["activations"] / 2)


@pytest.mark.parametrize("recompute, passes", [("none", 8), ("full", 12)])
def test_the_all_to_alls_are_on_the_critical_path_and_none_at_cp_1(recompute, passes):
    costs, where = _costs(), Cluster(1, 2, H100)
    lay = Layout(1, 1, 1, "1f1b", 1, 2, recompute, cp=2)
    got = predict(costs, lay, where, 4, T, cp_method="all-to-all")
    # a micro-batch of 2 sequences, 1 of them in parts on each process: each of q, k, v and the
    # output is T × C fp32 elements; 4 a pass, forward, backward and under full recompute forward again
    each = comm.all_to_all(where, [0, 1], T * C * 4)
    assert got["context_s"] == pytest.approx(2 * 2 * passes * each)  # 2 micro-batches × 2 blocks
    costs.attention = None
    without = predict(costs, lay, where, 4, T)["pipeline_s"]
    assert got["pipeline_s"] - without == pytest.approx(got["context_s"])
    costs = _costs()
    flat = predict(costs, Layout(1, 1, 1, "1f1b", 1, 2, recompute), Cluster(1, 1, H100), 4, T)
    assert flat["context_s"] == 0.0
    costs.attention = None  # at cp 1 the attention facts change nothing
    assert predict(costs, Layout(1, 1, 1, "1f1b", 1, 2, recompute), Cluster(1, 1, H100), 4, T) == flat


def test_the_ring_counts_only_what_the_blocks_compute_does_not_hide():
    where, facts = Cluster(1, 4, H100), _facts(heads=4, kv=2, length=1024)
    lay = Layout(1, 1, 1, "1f1b", 1, 1, "none", cp=4)
    # a process's part, half a sequence's worth: 1024 positions × 2 key/value heads × (16 + 16), bf16
    step = comm.p2p(0.5 * 1024 * 2 * 32 * 2, *comm.link(where, [0, 1, 2, 3]))
    forward, backward = 3 * step, 6 * step  # C − 1 steps forward; keys and values, then their gradients

    def added(compute: float) -> tuple[float, ...]:
        times = [(1.0, 1.0, 1.0, 1.0), (compute, compute, 0.0, compute)]
        out, _, per = exchanges(facts, lay, 0.5, where, [0, 1, 2, 3], "ring", True, times, [(0.0,) * 4] * 2)
        assert out[0] == times[0] and per[0] == 0.0  # the block without attention
        return tuple(a - b for a, b in zip(out[1], times[1]))

    assert added(1.0) == (0.0, 0.0, 0.0, 0.0)  # hidden behind a second of compute
    assert added(0.0) == pytest.approx((forward, backward, 0.0, backward))  # nothing to hide behind
    assert added(forward) == pytest.approx((0.0, backward - forward, 0.0, backward - forward))


def test_the_reduction_runs_over_dp_times_cp():
    costs = _costs()
    where = Cluster(1, 4, H100)
    ddp = predict(costs, Layout(2, 1, 1, "1f1b", 1, 1, "none", cp=2), where, 4, T)
    grads, link = ddp["memory"]["grads"], comm.link(where, [0, 1, 2, 3], "all_reduce")  # whole under DDP
    # on a GPU beside the backward: what the compute does not hide (`reduction.exposed`)
    whole = comm.all_reduce(grads, 4, *link)
    assert ddp["reduce_s"] == pytest.approx(exposed(whole, ddp["pipeline_s"], costs.n_blocks + 1))
    alone = predict(costs, Layout(1, 1, 1, "1f1b", 1, 1, "none", cp=2), Cluster(1, 2, H100), 4, T)
    assert alone["reduce_s"] > 0  # dp 1, but its cp processes share the weights


PLAN = ["plan", "--model", "gpt", "--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--seq-len", "64",
        "--batch-size", "8", "--gpus-per-node", "4", "--device", "h100", "--costs", "formula"]


def test_cp_flag_keeps_one_degree_and_writes_it(cli, tmp_path):
    toml = tmp_path / "plan.toml"
    done = cli(*PLAN, "--cp", "2", "--json", "--write-config", str(toml))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["cp_method"] == "ring" and {r["layout"]["cp"] for r in result["rows"]} == {2}
    assert "cp = 2" in toml.read_text() and 'cp_method = "auto"' in toml.read_text()
    free = json.loads(cli(*PLAN, "--json", "--cp-method", "all-to-all").stdout)
    assert {r["layout"]["cp"] for r in free["rows"]} == {1, 2, 4}  # 4 heads: cp 4 at tp 1 alone
    assert {r["layout"]["tp"] for r in free["rows"] if r["layout"]["cp"] == 4} == {1}


BAD = [
    (["--cp", "3"], "--cp 3 does not divide the cluster's 4 ranks"),
    (["--cp", "2", "--seq-len", "63"], "--seq-len 63 does not split into --cp 2 × 2 chunks (ring) = 4"),
    (["--cp", "4", "--n-head", "2", "--cp-method", "all-to-all"], "gpt has 2 attention heads, which --cp 4"),
    (["--cp", "2", "--tp", "2", "--n-head", "2", "--cp-method", "all-to-all"], "--cp 2 × --tp 2 = 4 does"),
    (["--cp", "2", "--experts", "4", "--top-k", "2", "--ep", "2"], "--cp 2 with --ep 2: context parallel"),
    (["--cp", "-1"], "--cp -1: must be ≥ 0"),
    (["--cp", "2", "--model", "mlp"], "--cp 2 but mlp calls no attention"),
    (["--dp", "2", "--pp", "2", "--cp", "2"], "--dp 2 × --pp 2 × --cp 2 = 8, but the cluster has 4 ranks"),
    (["--cp-method", "sideways"], "--cp-method 'sideways': expected one of auto, all-to-all, ring"),
]


@pytest.mark.parametrize("args, words", BAD)
def test_a_bad_cp_is_one_line(cli, args, words):
    done = cli(*PLAN, *args)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert words in done.stderr, done.stderr


def test_ring_on_a_cpu_target_is_one_line():
    from dataclasses import replace

    from brigade.errors import BrigadeError
    from brigade.planner.context import method

    assert method("auto", H100) == "ring" and method("auto", TABLE["a100"]) == "ring"
    cpu = replace(H100, name="cpu", cores=2)
    assert method("auto", cpu) == "all-to-all"
    with pytest.raises(BrigadeError, match="--cp-method ring on cpu: torch's ring attention runs on CUDA"):
        method("ring", cpu)


def test_llama_3_1_8b_at_131072_positions_fits_8_h100s(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra (scripts/setup.sh installs it)")
    from brigade.planner.config import PlanConfig
    from brigade.planner.run import plan
    from brigade.results.big_plans import LLAMA31, SIZES

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA31, **SIZES["8B"]}))
    rows = plan(PlanConfig(model=f"hf:{tmp_path}", seq_len=131072, batch_size=8, gpus_per_node=8,
                           device="h100", precision="bf16", costs="formula", recompute="full", pp=1, tp=1,
                           microbatches="1,4"))["rows"]
    best = rows[0]  # without tp or a pipeline, only a quarter of each sequence a GPU fits
    assert best["label"] == "shard 2 × cp 4, m 4, recompute full" and best["fits"]
    assert best["memory"]["peak"] < 80e9 and best["context_s"] < best["step_s"] / 100  # the ring hides
    whole = next(r for r in rows if r["label"] == "shard 8, m 1, recompute full")  # the same states
    assert not any(r["fits"] for r in rows if r["layout"]["cp"] == 1)
    assert whole["memory"]["activations"] == pytest.approx(4 * best["memory"]["activations"], rel=0.01)


def test_a_chunked_loss_holds_one_chunks_logits_and_runs_the_head_again(tmp_path):
    """Llama 3.1 8B at 131,072 positions: under --chunked-loss auto (training's default) a step
    holds one chunk's logits and loss buffers, not the sequence's (128,256 × 131,072 fp32 logits are
    63 GiB), and the head's forward runs again in the backward; off plans the whole sequence's."""
    pytest.importorskip("transformers", reason="the hf extra (scripts/setup.sh installs it)")
    from brigade.errors import BrigadeError
    from brigade.planner.config import PlanConfig
    from brigade.planner.run import plan
    from brigade.results.big_plans import LLAMA31, SIZES

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA31, **SIZES["8B"]}))
    got = {}
    for mode in ("auto", "off"):
        cfg = PlanConfig(model=f"hf:{tmp_path}", seq_len=131072, batch_size=8, gpus_per_node=8,
                         device="h100", precision="bf16", costs="formula", recompute="full", pp=1, tp=1,
                         cp=4, shard=2, microbatches="4", chunked_loss=mode)
        (got[mode],) = plan(cfg)["rows"][:1]
    logits = 131072 // 4 * 128256 * 4  # a cp rank's quarter of one sequence's fp32 logits
    assert got["off"]["memory"]["peak"] - got["auto"]["memory"]["peak"] > logits
    assert got["auto"]["step_s"] > got["off"]["step_s"]
    with pytest.raises(BrigadeError, match="--loss-chunk 0: a chunk takes at least 1 position"):
        plan(PlanConfig(model=f"hf:{tmp_path}", seq_len=131072, device="h100", costs="formula", loss_chunk=0))


def test_a_schedule_that_splits_the_backward_is_planned_with_its_loss_whole(tmp_path):
    """Training chunks no loss under a plan with weight passes (`parallel.assemble`): nor does the
    plan of such a layout, while 1F1B's last stage holds one chunk's logits (a Llama of 2 small
    layers and Llama 3's vocabulary, whose logits outweigh the rest at 4,096 positions)."""
    pytest.importorskip("transformers", reason="the hf extra (scripts/setup.sh installs it)")
    from brigade.planner.config import PlanConfig
    from brigade.planner.run import plan
    from brigade.results.big_plans import LLAMA31

    small = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
             "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA31, **small}))
    last = {}
    for mode in ("on", "off"):
        cfg = PlanConfig(model=f"hf:{tmp_path}", seq_len=4096, batch_size=8, gpus_per_node=2, device="h100",
                         costs="formula", recompute="none", pp=2, schedules="1f1b,zb", microbatches="4",
                         chunked_loss=mode)
        last[mode] = {r["layout"]["schedule"]: r["memory_per_stage_rank"][-1]["peak"] for r in plan(cfg)["rows"]}
    assert last["on"]["zb"] == last["off"]["zb"]
    assert last["on"]["1f1b"] < last["off"]["1f1b"] - 4096 // 2 * 128256 * 4  # half the logits at least
