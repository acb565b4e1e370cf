"""`world.mesh.fake_world`: this process as rank 0 of a world whose other processes are not there."""

import torch.distributed as dist

from brigade.world.mesh import fake_world


def test_no_fake_world_where_this_process_is_already_in_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with fake_world(2) as mesh:
            assert mesh is None
    finally:
        dist.destroy_process_group()
