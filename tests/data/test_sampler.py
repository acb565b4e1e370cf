"""brigade.data.sampler: per-epoch permutations, one global cursor, a replica's slice."""

import torch

from brigade.data.sampler import Sampler, fingerprint


def test_sampler_is_deterministic_and_resumable():
    a = Sampler(100, 8, seed=1)
    first = [a.next_global() for _ in range(30)]  # crosses two epoch boundaries
    b = Sampler(100, 8, seed=1, cursor=8 * 17)
    assert all(torch.equal(x, y) for x, y in zip(first[17:], [b.next_global() for _ in range(13)]))
    assert a.epoch == 2
    epoch0 = torch.cat(first[:13])[:100]
    assert sorted(epoch0.tolist()) == list(range(100))  # a permutation per epoch


def test_shards_do_not_depend_on_dp():
    batch = Sampler(1000, 12, seed=0).next_global()
    for dp in (1, 2, 3, 4):
        assert torch.equal(torch.cat([Sampler.shard(batch, r, dp) for r in range(dp)]), batch)


def test_the_fingerprint_tells_batches_apart_by_content_and_order():
    a = torch.tensor([3, 1, 2])
    assert fingerprint(a) == fingerprint(a.clone()) != fingerprint(torch.tensor([1, 2, 3]))
    assert len(fingerprint(a)) == 16


def test_past_the_drawn_size_the_permutation_is_computed_and_still_a_permutation(monkeypatch):
    from brigade.data import sampler

    monkeypatch.setattr(sampler, "DRAWN", 100)
    for n in (101, 1000, 4097):
        s = Sampler(n, 7, seed=3)
        epoch = torch.cat([s.next_global() for _ in range(n // 7)])
        assert len(set(epoch.tolist())) == len(epoch) and int(epoch.max()) < n  # no repeats, in range
        whole = sampler.feistel_permute(torch.arange(n), n, torch.tensor([5, 6, 7, 8, 9, 10]))
        assert sorted(whole.tolist()) == list(range(n))
        assert whole.tolist() != list(range(n))  # shuffled
    again = Sampler(1000, 7, seed=3, cursor=7 * 50)
    first = Sampler(1000, 7, seed=3)
    seen = [first.next_global() for _ in range(60)]
    assert all(torch.equal(a, b) for a, b in zip(seen[50:], [again.next_global() for _ in range(10)]))
    other_epoch = Sampler(1000, 1000, seed=3)
    e0, e1 = other_epoch.next_global(), other_epoch.next_global()
    assert sorted(e0.tolist()) == sorted(e1.tolist()) and not torch.equal(e0, e1)


def test_a_small_corpus_is_drawn_as_it_always_was():
    """Up to DRAWN examples: torch.randperm of (seed, epoch), the order every earlier run read."""
    g = torch.Generator().manual_seed(1 * 1_000_003 + 0)
    assert torch.equal(Sampler(500, 500, seed=1).next_global(), torch.randperm(500, generator=g))
