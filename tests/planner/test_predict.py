"""`planner.predict`'s step: what sharding adds (per-block collectives at the device's collective
bandwidth, DTensor's dispatch in the optimizer) and what crowded cores do to the step's phases."""

from dataclasses import replace

import pytest

from brigade.planner.cluster import Cluster
from brigade.planner.devices import TABLE
from brigade.planner.predict import predict
from brigade.planner.reduction import exposed
from brigade.planner.space import Layout
from tests.planner.test_memory import OUT, _costs


def _device(**fields):
    return replace(TABLE["h100"], intra_latency=0.0, **fields)


def test_a_sharded_step_pays_each_blocks_collectives_and_dtensor_dispatch_per_parameter():
    costs = _costs()  # four blocks of one 100-byte parameter; AdamW's step free
    shard = Layout(1, 2, 1, "1f1b", 1, 1, "none")
    plain = predict(costs, shard, Cluster(1, 2, _device()), batch=8, seq_len=1)
    slow = _device(reduce_scatter_bw=1.0, all_gather_bw=2.0, coll_latency=0.5, dtensor_step_s=3.0)
    row = predict(costs, shard, Cluster(1, 2, slow), batch=8, seq_len=1)
    # 5 units (4 blocks, the root) of 80 bytes: RS ½·80/1 + 0.5, AG ½·80/2 + 0.5 each; without a
    # pipeline FSDP gathers each block twice (forward, backward) and reduces it every micro-batch;
    # on a GPU beside the compute, exposed where longer than it and one unit's share (`exposed`)
    whole = 5 * (40 + 0.5 + 2 * (20 + 0.5))
    assert row["reduce_s"] == pytest.approx(exposed(whole, row["pipeline_s"], 5))
    assert whole / 5 < row["reduce_s"] < whole
    two = predict(costs, replace(shard, microbatches=2), Cluster(1, 2, slow), batch=8, seq_len=1)
    assert two["reduce_s"] == pytest.approx(exposed(2 * whole, two["pipeline_s"], 5))
    half = predict(costs, shard, Cluster(1, 2, slow), batch=8, seq_len=1, precision="bf16")
    halved = 5 * (40 + 0.5 + 2 * (10 + 0.5))  # bf16 gathers half the bytes
    assert half["reduce_s"] == pytest.approx(exposed(halved, half["pipeline_s"], 5))
    # under a pipeline once a step, gathered once: 3 units (the rank's 2 blocks, the root), after
    # the pipeline (not overlapped)
    piped = predict(costs, Layout(1, 2, 2, "1f1b", 1, 2, "none"), Cluster(1, 4, slow), batch=8, seq_len=1)
    each = 2 * 100 / 3  # the rank's whole gradient (its 2 blocks' 200 bytes) over its 3 units
    assert piped["reduce_s"] == pytest.approx(3 * (each / 2 + 0.5 + each / 4 + 0.5))
    assert row["optimizer_s"] - plain["optimizer_s"] == pytest.approx(4 * 3.0)  # four parameters
    ddp = predict(costs, Layout(2, 1, 1, "1f1b", 1, 1, "none"), Cluster(1, 2, slow), batch=8, seq_len=1)
    assert ddp["optimizer_s"] == plain["optimizer_s"] == 0.0  # plain tensors: no dispatch added


def test_crowded_cores_take_turns_at_the_reduction_and_the_optimizer_step():
    costs = replace(_costs(), optimizer_s_per_byte=1e-3)
    cpu = _device(cores=2, all_reduce_bw=1.0)
    # HSDP under a pipeline: one reduction at the step's end, every rank at once
    hsdp = Layout(2, 2, 2, "1f1b", 1, 2, "none")
    four = predict(costs, hsdp, Cluster(1, 8, cpu), batch=8, seq_len=1)
    spread = predict(costs, hsdp, Cluster(1, 8, replace(cpu, cores=8)), batch=8, seq_len=1)
    assert four["reduce_s"] == pytest.approx(4 * spread["reduce_s"]) and spread["reduce_s"] > 0
    assert four["optimizer_s"] == pytest.approx(4 * spread["optimizer_s"]) and spread["optimizer_s"] > 0
    # without a pipeline FSDP reduces block by block through the step: gloo's copies and sums on
    # the same shared cores all the same
    whole = Layout(2, 2, 1, "1f1b", 1, 1, "none")
    four = predict(costs, whole, Cluster(1, 4, cpu), batch=8, seq_len=1)
    spread = predict(costs, whole, Cluster(1, 4, replace(cpu, cores=4)), batch=8, seq_len=1)
    assert four["reduce_s"] == pytest.approx(2 * spread["reduce_s"]) and spread["reduce_s"] > 0
    assert four["optimizer_s"] == pytest.approx(2 * spread["optimizer_s"]) and spread["optimizer_s"] > 0


def test_fsdps_own_work_is_paid_each_cycle_where_it_was_measured_here():
    cpu = _device(cores=2)
    costs = replace(_costs(), shard_s=[1.0, 2.0, 3.0, 4.0])  # seconds a cycle, per block
    bare = replace(costs, shard_s=[])

    def extra(layout, world, c=costs):
        got = predict(c, layout, Cluster(1, world, cpu), batch=8, seq_len=1)["reduce_s"]
        return got - predict(bare, layout, Cluster(1, world, cpu), batch=8, seq_len=1)["reduce_s"]

    # without a pipeline every block, every micro-batch
    assert extra(Layout(1, 2, 1, "1f1b", 1, 2, "none"), 2) == pytest.approx(2 * 10.0)
    # under a pipeline once a step, on the busiest rank (blocks 2 and 3); 4 ranks on 2 cores: twice
    assert extra(Layout(1, 2, 2, "1f1b", 1, 2, "none"), 4) == pytest.approx(2 * 7.0)
    # unsharded, or costs not measured on this machine (a GPU's FSDP2 copies on its own streams)
    assert extra(Layout(2, 1, 1, "1f1b", 1, 2, "none"), 2) == 0.0
    assert extra(Layout(1, 2, 1, "1f1b", 1, 2, "none"), 2, replace(costs, source="scaled")) == 0.0


def test_the_runtimes_own_time_is_added_to_every_action_and_to_the_step():
    costs = _costs()
    pp = Layout(1, 1, 2, "1f1b", 1, 4, "none")
    plain = predict(costs, pp, Cluster(1, 2, _device()), batch=8, seq_len=1)
    own = predict(costs, pp, Cluster(1, 2, _device(action_s=0.5, runtime_step_s=7.0)), batch=8, seq_len=1)
    # 1F1B over 2 stages at m 4: 10 actions on the critical path (2 (m + p - 1)), each 0.5 longer
    assert own["pipeline_s"] - plain["pipeline_s"] == pytest.approx(10 * 0.5)
    assert own["step_s"] - plain["step_s"] == pytest.approx(10 * 0.5 + 7.0)


def test_an_action_costs_the_crowded_figure_where_a_host_has_more_processes_than_cores():
    costs = _costs()
    pp = Layout(1, 1, 2, "1f1b", 1, 4, "none")
    spread = _device(action_s=0.5, crowded_action_s=2.0, cores=2)
    base = predict(costs, pp, Cluster(1, 2, replace(spread, action_s=0.0, crowded_action_s=0.0)), batch=8,
                   seq_len=1)
    alone = predict(costs, pp, Cluster(1, 2, spread), batch=8, seq_len=1)  # 2 processes, 2 cores
    assert alone["pipeline_s"] - base["pipeline_s"] == pytest.approx(10 * 0.5)  # 10 on the critical path
    crowded = replace(spread, cores=1)
    one = predict(costs, pp, Cluster(1, 2, crowded), batch=8, seq_len=1)
    none = predict(costs, pp, Cluster(1, 2, replace(crowded, action_s=0.0, crowded_action_s=0.0)), batch=8,
                   seq_len=1)
    # on one core the step is both ranks' work: 16 actions, each 2.0 longer
    assert one["pipeline_s"] - none["pipeline_s"] == pytest.approx(16 * 2.0)
    unset = predict(costs, pp, Cluster(1, 2, replace(crowded, crowded_action_s=0.0)), batch=8, seq_len=1)
    assert unset["pipeline_s"] - none["pipeline_s"] == pytest.approx(16 * 0.5)  # 0: action_s


def test_tp_is_priced_from_one_tp_processs_measured_blocks_and_each_collective_it_issues():
    from brigade.planner.costs import MEASURED
    from brigade.planner.split_costs import SplitCosts
    from brigade.planner.tensor import TensorFacts

    costs = _costs()
    costs.tensor = TensorFacts((1.0,) * 4, (1,) * 4, (1, 2))
    split = SplitCosts(2, {1: [(3.0, 5.0, 2.0, 3.0)] * 4}, [(4, 6)] * 4, [0.0] * 4, [0.0] * 4)
    costs.modes["none"].split = split
    tp = Layout(1, 1, 1, "1f1b", 1, 1, "none", tp=2)
    device = _device(tp_collective_s=0.5, all_gather_bw=1e30)  # bytes free: the price alone
    row = predict(costs, tp, Cluster(1, 2, device), batch=1, seq_len=1)
    # per block: F 3 + 4 collectives, B 5 + 6 of them, each 0.5
    assert row["pipeline_s"] == pytest.approx(4 * (3 + 4 * 0.5 + 5 + 6 * 0.5))
    # the device does not price a tp collective, or the costs were scaled to another device:
    # the split share ÷ tp and each row-wise layer's all-reduces, as before
    unpriced = predict(costs, tp, Cluster(1, 2, _device()), batch=1, seq_len=1)
    all_reduce = 2 * (1 / 2) * OUT / TABLE["h100"].intra_bw  # of a block's output, at tp 2
    assert unpriced["pipeline_s"] == pytest.approx(4 * ((1 + 2) / 2 + 2 * all_reduce))
    scaled = predict(replace(costs, source="scaled"), tp, Cluster(1, 2, device), batch=1, seq_len=1)
    assert scaled["pipeline_s"] == pytest.approx(unpriced["pipeline_s"])
    assert costs.source == MEASURED


def test_a_tp_collectives_wait_comes_on_top_of_the_compute_shared_on_cores():
    from brigade.planner.split_costs import SplitCosts
    from brigade.planner.tensor import TensorFacts

    costs = _costs()
    costs.tensor = TensorFacts((1.0,) * 4, (1,) * 4, (1, 2))
    costs.modes["none"].split = SplitCosts(2, {1: [(1.0, 1.0, 0.5, 0.5)] * 4}, [(1, 1)] * 4, [0.0] * 4,
                                           [0.0] * 4)
    tp = Layout(1, 1, 2, "1f1b", 1, 4, "none", tp=2)
    cpu = _device(cores=2, tp_collective_s=1.0, crowded_tp_collective_s=3.0, all_gather_bw=1e30)
    row = predict(costs, tp, Cluster(1, 4, cpu), batch=4, seq_len=1)
    # 4 processes on 2 cores: each block's F and B take 1 + 3 (the crowded wait); 1F1B over two
    # stages of 2 blocks at m 4: 5 (m + p - 1) forwards and backwards on the critical path = 80.
    # The pipeline's 2 ranks get one core's worth; what they share it for is their compute only,
    # 2 ranks × 4 micro-batches × 2 blocks × 2 = 32 (with the waits as work it would be 128),
    # 12 more than the 20 their compute alone would take on cores of their own: on top of the 80
    assert row["pipeline_s"] == pytest.approx(5 * 2 * 2 * (1 + 3) + (32 - 20))
    slow = predict(costs, tp, Cluster(1, 4, replace(cpu, crowded_tp_collective_s=0.1)), batch=4, seq_len=1)
    # short waits: 22, and the same 12 on top
    assert slow["pipeline_s"] == pytest.approx(5 * 2 * 2 * 1.1 + 12)
    spread = predict(costs, tp, Cluster(1, 4, replace(cpu, cores=4)), batch=4, seq_len=1)
    assert spread["pipeline_s"] == pytest.approx(5 * 2 * 2 * (1 + 1))  # a core each: nothing on top


def test_the_trainers_small_collectives_are_added_once_a_step():
    lat = _device(coll_latency=0.5, all_reduce_bw=1.0)
    costs = _costs()  # four blocks of one 100-byte parameter
    tied = replace(costs, params=[{0: 100}, {1: 100}, {2: 100}, {0: 100}])  # the last uses the first's

    def syncs(c, layout, world):
        return predict(c, layout, Cluster(1, world, lat), batch=8, seq_len=1)["sync_s"]

    assert syncs(costs, Layout(1, 1, 1, "1f1b", 1, 1, "none"), 1) == 0.0  # one process: none
    # dp 2: the loss's mean over replicas, 4 bytes: 2·½·4/1 + 2·0.5
    assert syncs(costs, Layout(2, 1, 1, "1f1b", 1, 1, "none"), 2) == pytest.approx(5.0)
    # pp 2: the gradient norm's over pp; tied across the two ranks, the tie's 100 bytes too
    pp = Layout(1, 1, 2, "1f1b", 1, 4, "none")
    assert syncs(costs, pp, 2) == pytest.approx(5.0)
    assert syncs(tied, pp, 2) == pytest.approx(5.0 + 100 + 1.0)
    # shard 2 × pp 2: the loss over dp, the norm over shard and over pp; the tie shard by shard
    both = Layout(1, 2, 2, "1f1b", 1, 4, "none")
    assert syncs(tied, both, 4) == pytest.approx(3 * 5.0 + 50 + 1.0)
    row = predict(tied, pp, Cluster(1, 2, lat), batch=8, seq_len=1)
    assert row["step_s"] == pytest.approx(row["pipeline_s"] + row["reduce_s"] + row["optimizer_s"]
                                          + row["sync_s"])
