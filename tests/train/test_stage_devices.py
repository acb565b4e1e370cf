"""dp × local stages on GPUs: each stage's DDP group on that stage's GPU (checked without one)."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from brigade.config import ParallelConfig
from brigade.errors import BrigadeError
from brigade.train import layout, replicas


def test_local_stages_refuse_a_group_bound_to_another_gpu(monkeypatch):
    """LOCAL_RANK 1 with 2 local stages drives cuda:2 and cuda:3, not the cuda:1 of one GPU each."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    engine = SimpleNamespace(layout=SimpleNamespace(device=torch.device("cuda", 1), dp=2))
    with pytest.raises(BrigadeError, match=r"^the process group is bound to cuda:1 but stage 0 of "
                                           r"--local-stages 2 runs on cuda:2: pass local_stages=2"):
        layout.ProcessModel._local_pipeline(engine, [], [0, 1], ParallelConfig(local_stages=2), None, 2, None)


def test_a_stage_group_is_not_created_on_a_bound_default_group(monkeypatch):
    default = SimpleNamespace(bound_device_id=torch.device("cuda", 0))
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: default)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(BrigadeError, match=r"^the process group is bound to cuda:0 but this process "
                                           r"drives several GPUs: pass local_stages"):
        replicas.stage_group(torch.device("cuda", 1))


def test_a_stage_group_is_bound_to_its_own_gpu(monkeypatch):
    made = []
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group",
                        lambda: SimpleNamespace(bound_device_id=None))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: made.append((ranks, kw)) or "g")
    assert replicas.stage_group(torch.device("cuda", 3)) == "g"
    assert made == [([0, 1], {"device_id": torch.device("cuda", 3)})]
