import collections

import pytest
import torch

import brigade
from brigade.errors import BrigadeError
from brigade.pipeline.batches import microbatch


@pytest.mark.parametrize("n,m", [(8, 1), (8, 3), (8, 8), (10, 4), (10, 6), (7, 2)])
def test_split_gives_exactly_m_chunks_that_merge_back(n, m):
    x = torch.arange(n * 2).reshape(n, 2)
    chunks = microbatch.split(x, m)
    assert len(chunks) == m
    assert [c.shape[0] for c in chunks] == microbatch.sizes(n, m)
    assert max(microbatch.sizes(n, m)) - min(microbatch.sizes(n, m)) <= 1
    assert torch.equal(microbatch.merge(chunks), x)
    assert sum(microbatch.weights(n, m)) == pytest.approx(1.0)


def test_weighted_losses_equal_the_batch_mean():
    x = torch.randn(10, 3)
    parts = [c.pow(2).mean() * w for c, w in zip(microbatch.split(x, 4), microbatch.weights(10, 4))]
    assert torch.allclose(sum(parts), x.pow(2).mean())


@pytest.mark.parametrize("n,m,message", [(4, 5, "larger than the batch"), (4, 0, "at least 1")])
def test_bad_microbatch_counts(n, m, message):
    with pytest.raises(BrigadeError, match=message):
        microbatch.split(torch.zeros(n), m)


Pair = collections.namedtuple("Pair", "x y")


@pytest.mark.parametrize("n,m", [(8, 1), (8, 3), (7, 2), (5, 5)])
def test_split_structure_splits_every_batched_tensor_like_sizes(n, m):
    table = torch.randn(11, 4)  # a constant: no batch dimension
    scale = torch.tensor(2.0)
    obj = {"tokens": torch.arange(n * 3).reshape(n, 3), "pair": Pair(torch.randn(n), 5),
           "table": brigade.unbatched(table), "scale": scale, "mode": "train", "none": None}
    parts = microbatch.split_structure(obj, m, n)
    assert len(parts) == m
    assert [p["tokens"].shape[0] for p in parts] == microbatch.sizes(n, m)
    assert [p["pair"].x.shape[0] for p in parts] == microbatch.sizes(n, m)
    for p in parts:
        assert p["table"] is table and p["scale"] is scale and p["pair"].y == 5
        assert p["mode"] == "train" and p["none"] is None and isinstance(p["pair"], Pair)
    merged = microbatch.merge_structure(parts)
    assert torch.equal(merged["tokens"], obj["tokens"]) and torch.equal(merged["pair"].x, obj["pair"].x)
    assert merged["table"] is table and merged["scale"] is scale  # the same object: kept once


def test_split_structure_infers_the_batch_size_and_takes_plain_tensors():
    x = torch.arange(10)
    assert [len(c) for c in microbatch.split_structure((torch.tensor(1.0), x), 3)[0][1:]] == [4]
    assert [len(c) for c in microbatch.split_structure(x, 4)] == microbatch.sizes(10, 4)
    assert microbatch.batch_size_of({"a": brigade.unbatched(torch.ones(3, 2)), "b": torch.ones(6)}) == 6


def test_a_tensor_with_another_batch_dimension_is_named_with_a_fix():
    obj = {"tokens": torch.zeros(8, 3), "cache": [torch.zeros(8), torch.zeros(5, 2)]}
    with pytest.raises(BrigadeError, match=r"^input\['cache'\]\[1\] has 5 rows along dim 0 but the "
                                           r"batch has 8: .*brigade\.unbatched\(\.\.\.\)"):
        microbatch.split_structure(obj, 2, 8)


def test_no_batched_tensor_is_an_error():
    with pytest.raises(BrigadeError, match="has no tensor with a batch dimension"):
        microbatch.split_structure((torch.tensor(1.0), 3), 2)


def test_split_structure_checks_the_count_and_leaves():
    with pytest.raises(BrigadeError, match="larger than the batch"):
        microbatch.split_structure({"a": torch.zeros(2)}, 3)
    with pytest.raises(BrigadeError, match=r"input\['f'\] is a .*generator.*cannot be sent"):
        microbatch.split_structure({"a": torch.zeros(2), "f": (i for i in [])}, 2)


def test_unbatched_takes_only_tensors():
    with pytest.raises(BrigadeError, match=r"brigade.unbatched\(list\): expected a tensor"):
        brigade.unbatched([1, 2])


def test_merge_structure_stacks_scalars_and_refuses_differing_chunks():
    chunks = [(torch.ones(2, 3), torch.tensor(1.0)), (torch.ones(1, 3), torch.tensor(2.0))]
    merged = microbatch.merge_structure(chunks)
    assert merged[0].shape == (3, 3) and torch.equal(merged[1], torch.tensor([1.0, 2.0]))
    with pytest.raises(BrigadeError, match=r"micro-batch 1's output\['n'\] differs from micro-batch 0's"):
        microbatch.merge_structure([{"h": torch.ones(1), "n": 1}, {"h": torch.ones(1), "n": 2}])
    with pytest.raises(BrigadeError, match="no micro-batches"):
        microbatch.merge_structure([])
