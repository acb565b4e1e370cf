"""`measure.fake_world`: this process as rank 0 of a world whose other processes are not there,
and the collectives code issues, counted."""

import torch
import torch.distributed as dist

from brigade.measure.fake_world import Collectives, fake_world


def test_no_fake_world_where_this_process_is_already_in_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with fake_world(2) as mesh:
            assert mesh is None
    finally:
        dist.destroy_process_group()


def test_collectives_count_what_is_issued_not_its_waits():
    with fake_world(2) as mesh:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        part = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)])
        with Collectives() as counted:
            part.redistribute(mesh, [Replicate()]).to_local().sum()
        assert counted.n == 1
