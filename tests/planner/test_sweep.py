"""The tuner's predictions (`planner.sweep`): block costs interpolated between the measured sizes,
a pipeline's step simulated over the solver's cut, data parallel's step plus its all-reduce."""

import pytest

from brigade.planner.costs import interpolate
from brigade.planner.sweep import ddp_row, predict_pipeline


def test_prediction_balances_and_interpolates():
    samples = {2: [(1.0, 2.0, 1.0, 1.2)] * 4, 8: [(4.0, 8.0, 4.0, 4.8)] * 4}
    # one approx per block: pytest 9.2 refuses an approx nested in a list (a TypeError)
    assert interpolate(samples, 5) == [pytest.approx((2.5, 5.0, 2.5, 3.0))] * 4
    seconds, balance = predict_pipeline(samples, batch=16, m=2, schedule="1f1b", ranks=2, comm_per_sample=0.0)
    assert balance == [2, 2]
    # size 8: each stage F = 8, B = 16; 1F1B over 2 stages and 2 micro-batches ends at 72
    assert seconds == pytest.approx(72.0)


def test_prediction_with_two_stages_per_rank_cuts_and_costs_p_times_v_stages():
    samples = {1: [(1.0, 2.0, 1.0, 1.0)] * 4}
    # one micro-batch runs every stage in turn: 4 F of 1 and 4 B of 2 = 12, plus a hop of 10
    # per cut between ranks: 1 each way on 2 stages, 3 each way on 4 stages (ranks 0,1,0,1)
    one = predict_pipeline(samples, batch=1, m=1, schedule="looped-bfs", ranks=2, comm_per_sample=10.0)
    two = predict_pipeline(samples, batch=1, m=1, schedule="looped-bfs", ranks=2, comm_per_sample=10.0,
                           virtual=2)
    assert one == (pytest.approx(32.0), [2, 2])
    assert two == (pytest.approx(72.0), [1, 1, 1, 1])


def test_data_parallel_is_predicted_as_one_device_on_half_the_batch_plus_the_all_reduce():
    samples = {2: [(1.0, 2.0, 1.0)] * 4, 8: [(4.0, 8.0, 4.0)] * 4}
    row = ddp_row(samples, batch=8, dp=2, allreduce_s=0.5)
    # size 4 interpolates to F = 2, B = 4 per block: 4 blocks cost 24, then the all-reduce
    assert row["predicted_s"] == pytest.approx(24.5)
    assert (row["dp"], row["pp"], row["schedule"], row["balance"]) == (2, 1, None, None)
