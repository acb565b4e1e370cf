"""`measure.stages.gathered_stage_costs`: every rank's stages gathered on every rank, measured all at
once or, where ranks outnumber cores, one rank at a time (`turns`)."""

import pytest

from tests.pipeline.transport.test_p2p import _spawn


def _gather(rank: int, world: int, port: int, turns: bool, out) -> None:
    """Each rank "measures" its stage with a stand-in that sleeps and records when it ran."""
    import time

    import torch
    import torch.distributed as dist
    from torch import nn

    from brigade.measure import stages

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    spans = []

    def measured(module, x, loss_fn=None, target=None, first=False, repeats=10):
        start = time.monotonic()  # system-wide: comparable between the processes
        time.sleep(0.3)
        spans.append((start, time.monotonic()))
        return (rank + 1.0, rank + 2.0, rank + 3.0, rank + 4.0)

    stages.stage_costs = measured
    got = stages.gathered_stage_costs([nn.Identity()] * world, rank, torch.zeros(4, 2), torch.zeros(4), None,
                                      m=2, turns=turns)
    out.put((rank, spans, got))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_stage_costs_measured_in_turns_never_overlap_and_are_gathered_alike():
    results = _spawn(_gather, 2, True)
    (first,), _ = results[0]
    (second,), _ = results[1]
    assert second[0] >= first[1]  # rank 1 began after rank 0 ended
    want = ([1.0, 2.0], [2.0, 3.0], [3.0, 4.0], [4.0, 5.0])  # (forward, backward, weight, input)
    assert all(tuple(got) == want for _, got in results.values())
