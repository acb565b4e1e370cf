import pytest
import torch

from brigade.errors import BrigadeError
from brigade.pipeline import microbatch


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
