"""`planner.split_costs`: a model's blocks measured as one of two tensor-parallel processes runs
them, in this process, on a world whose other process is not there."""

import torch
import torch.distributed as dist

from brigade.models.gpt import GPTConfig, gpt, gpt_loss
from brigade.planner.split_costs import measure_split
from brigade.world.mesh import fake_world


def _blocks():
    torch.manual_seed(0)
    return gpt(GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=8))


def _memory(blocks, x, y, s):  # costs' own memory measurement is not what is tested here
    n = len(blocks)
    return [0.0] * n, [1.0] * n, [2.0] * n, [0.0] * n, [3.0] * n


def test_each_block_is_timed_on_one_tp_process_and_its_collectives_counted():
    blocks = _blocks()
    x = torch.randint(0, 96, (4, 8))
    with fake_world(2) as mesh:
        got = measure_split(blocks, x, torch.randint(0, 96, (4, 8)), gpt_loss, [2, 4], "none", mesh,
                            _memory, repeats=1)
    assert not dist.is_initialized()  # the fake world is gone again
    assert got.tp == 2 and sorted(got.times) == [2, 4]
    assert all(len(row) == 4 and min(row) >= 0 for rows in got.times.values() for row in rows)
    # the embedding and the head are whole (empty plans); each GPT block under sequence parallel
    # gathers twice and reduce-scatters twice in its forward; its backward reduce-scatters the two
    # gathers' gradients, all-gathers the two row-wise outputs' and gathers the two saved parts
    # again (`save_parts`); the first block's input comes whole: its backward gathers the gradient
    assert got.collectives == [(0, 0), (4, 7), (4, 6), (1, 0)]
    assert got.working == [1.0] * 4 and got.transient == [2.0] * 4 and got.accumulating == [3.0] * 4
    # the blocks given stay as they were: measured on a copy
    assert not any(type(p).__name__ == "DTensor" for p in blocks[1].parameters())


def test_a_recomputed_block_gathers_again_in_its_backward_and_keeps_no_parts():
    with fake_world(2) as mesh:
        got = measure_split(_blocks(), torch.randint(0, 96, (2, 8)), torch.randint(0, 96, (2, 8)), gpt_loss,
                            [2], "full", mesh, _memory, repeats=1)
    # the forward replayed in the backward issues its 4 again; the backward's own 4 (no saved parts)
    assert got.collectives[2] == (4, 8)
