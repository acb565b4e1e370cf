"""`host.cores.shared_cores`: the cores a pipeline's ranks share, in ranks' worth, where the host
gives each less than it needs; 0 where each has its own."""

from brigade.host.cores import host_cores, shared_cores


def test_ranks_that_outnumber_the_cores_share_them():
    assert shared_cores(4, 4, cores=2) == 2.0  # bench --ranks 4 on two cores
    assert shared_cores(2, 8, cores=2) == 0.5  # one of four 2-rank pipelines on the host
    assert shared_cores(2, 2, threads=2, cores=2) == 1.0  # a rank of 2 threads needs 2 cores


def test_ranks_with_cores_enough_or_a_gpu_do_not_share():
    assert shared_cores(2, 2, cores=2) == 0.0
    assert shared_cores(4, 4, device_type="cuda", cores=1) == 0.0
    assert shared_cores(4, 4, cores=None) == (0.0 if host_cores() >= 4 else 4 * host_cores() / 4)
    assert host_cores() >= 1
