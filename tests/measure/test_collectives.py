"""`measure.collectives`: the collectives code issues, counted."""

import torch

from brigade.measure.collectives import Collectives
from brigade.world.mesh import fake_world


def test_collectives_count_what_is_issued_not_its_waits():
    with fake_world(2) as mesh:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        part = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)])
        with Collectives() as counted:
            part.redistribute(mesh, [Replicate()]).to_local().sum()
        assert counted.n == 1
