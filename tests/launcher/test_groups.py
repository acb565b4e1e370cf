"""Which GPU a process drives: the one choice `init`, `info` and the layout share."""

import pytest
import torch
import torch.distributed as dist

from brigade.errors import BrigadeError
from brigade.launcher import groups, rendezvous


def cuda(*indices):
    return [torch.device("cuda", i) for i in indices]


@pytest.mark.parametrize("local_rank,n,count,want", [
    (3, 1, 8, cuda(3)),        # torchrun: every process sees the node's GPUs
    (3, 1, 1, cuda(0)),        # Slurm's binding: each task sees its own GPU only
    (3, 1, 2, cuda(1)),        # two visible, rank 3: wrap around
    (1, 2, 4, cuda(2, 3)),     # --local-stages 2, all visible: rank 1 drives 2 and 3
    (1, 2, 2, cuda(0, 1)),     # --local-stages 2, each task sees its two
    (3, 2, 4, cuda(2, 3)),
])
def test_device_is_local_rank_when_visible_else_wraps(monkeypatch, local_rank, n, count, want):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert groups.local_devices("cuda", local_rank, n) == want


def test_too_few_visible_gpus_for_the_local_stages_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(BrigadeError, match=r"^--local-stages 2 needs 2 GPUs per process but 1 are visible"):
        groups.local_devices("cuda", 0, 2)


def test_cpu_repeats_for_every_stage():
    assert groups.local_devices("cpu", 5, 3) == [torch.device("cpu")] * 3


@pytest.fixture
def one_visible_gpu_at_local_rank_3(monkeypatch):
    """A CUDA world as Slurm binds it (one GPU, LOCAL_RANK 3), its group already up."""
    bound = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    for k, v in {"LOCAL_RANK": "3", "RANK": "3", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "LOCAL_WORLD_SIZE": "4",
                 "GROUP_RANK": "0", "TORCH_GLOO_LAZY_INIT": "1"}.items():  # init sets the last
        monkeypatch.setenv(k, v)
    return bound


def test_init_and_info_bind_the_one_visible_gpu(one_visible_gpu_at_local_rank_3):
    got = groups.init("nccl")
    assert got.device == torch.device("cuda", 0) and got.local_rank == 3
    assert one_visible_gpu_at_local_rank_3 == [torch.device("cuda", 0)]
    assert groups.info("nccl").device == torch.device("cuda", 0)


def test_init_binds_the_first_of_a_process_s_local_stages(one_visible_gpu_at_local_rank_3, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert groups.init("nccl", local_stages=2).device == torch.device("cuda", 6)
    assert groups.info("nccl", local_stages=2).device == torch.device("cuda", 6)


@pytest.mark.parametrize("local_stages,bound", [(1, True), (2, False)])
def test_the_default_group_is_bound_only_to_a_process_s_single_gpu(
        one_visible_gpu_at_local_rank_3, monkeypatch, local_stages, bound):
    """torch lets a new group bind only the default group's device: a process that drives several
    GPUs leaves the default group unbound, so each stage's group can bind its own."""
    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(kw))
    monkeypatch.setattr(rendezvous, "loopback_store", lambda timeout: None)
    groups.init("nccl", local_stages=local_stages)
    first = torch.device("cuda", 3 * local_stages)
    assert calls and ("device_id" in calls[0]) == bound
    assert calls[0].get("device_id", first) == first


@pytest.fixture
def joining_fails(one_visible_gpu_at_local_rank_3, monkeypatch):
    """`joining_fails(message)`: the next init_process_group raises DistBackendError(message)."""
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(rendezvous, "loopback_store", lambda timeout: None)

    def fail_with(message: str) -> None:
        def refuse(backend, **kw):
            raise dist.DistBackendError(message)
        monkeypatch.setattr(dist, "init_process_group", refuse)
    return fail_with


def test_two_processes_on_one_gpu_is_one_line(joining_fails):
    """NCCL refuses two ranks on one GPU (seen on a one-GPU H200: a Python API launch of 2
    processes); brigade says so in one line instead of NCCL's invalid-usage report."""
    joining_fails("NCCL error in: NCCLUtils.cpp:93, invalid usage\nncclInvalidUsage: ...\nLast error:\n"
                  "Duplicate GPU detected : rank 3 and rank 0 both on CUDA device 60")
    with pytest.raises(BrigadeError) as err:
        groups.init("nccl")
    msg = str(err.value)
    assert "\n" not in msg and "rank 3" in msg and "cuda:0" in msg and "one GPU per process" in msg
    assert "--backend gloo" in msg


def test_other_nccl_errors_pass_through(joining_fails):
    joining_fails("NCCL error: unhandled system error")
    with pytest.raises(dist.DistBackendError, match="unhandled system error"):
        groups.init("nccl")
