"""Weighted mixing of corpora (brigade/data/mix.py): shares kept to the weights in every prefix of
a cycle, each example a pure function of its index (so the sampler's cursor resumes it), the
GPT's vocabulary all of the texts', and each mistake one line."""

import pytest
import torch

from brigade.data import mix
from brigade.data.chars import load_text_data
from brigade.errors import BrigadeError


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1, 1], [5, 0, 2], [0.001, 1]])
def test_each_prefix_of_a_cycle_keeps_every_share_within_one_example(weights):
    per = mix.counts(weights)
    assert sum(per) == mix.CYCLE
    assert all(abs(c - w / sum(weights) * mix.CYCLE) < 1 for c, w in zip(per, weights))
    order = mix.interleave(per)
    taken = [0] * len(per)
    for i, k in enumerate(order):
        taken[k] += 1
        assert all(abs(taken[q] - per[q] * (i + 1) / mix.CYCLE) <= 1 for q in range(len(per)))
    assert taken == per


class Part:
    """A corpus of `n` examples whose example j is the row [tag, j]."""

    def __init__(self, tag: int, n: int):
        self.tag, self.n = tag, n

    def __len__(self):
        return self.n

    def batch(self, indices):
        rows = torch.stack([torch.full_like(indices, self.tag), indices], 1)
        return rows, rows


def test_the_mixture_draws_by_weight_and_reads_each_corpus_in_turn():
    m = mix.Mixture([Part(0, 50), Part(1, 5000)], [0.7, 0.3])
    assert len(m) == 5050
    x, _ = m.batch(torch.arange(2 * mix.CYCLE))
    tags, examples = x[:, 0], x[:, 1]
    assert (tags == 0).sum() == 2 * 700 and (tags == 1).sum() == 2 * 300
    assert examples[tags == 0].tolist() == [j % 50 for j in range(1400)]  # the small one repeats
    assert examples[tags == 1].tolist() == list(range(600))
    again, _ = m.batch(torch.tensor([1999, 3, 1500]))  # any order, any subset: the same examples
    assert again.tolist() == x[[1999, 3, 1500]].tolist()


def test_a_plain_path_is_no_mixture():
    assert mix.parse("") is None and mix.parse("notes.txt") is None


@pytest.mark.parametrize("spec,message", [
    ("{a},{b}:0.3", "'{a}' has no weight: give each corpus one, as path:weight"),
    ("{a}:0.7,{b}:-1", "'{b}' has weight -1: weights are numbers ≥ 0"),
    ("{a}:0,{b}:0", "the weights sum to 0: give at least one corpus a weight above 0"),
    ("{a}:0.7,{tmp}/none.txt:0.3", "corpus '{tmp}/none.txt' (weight 0.3) not found"),
])
def test_a_mixture_that_cannot_be_is_one_line(tmp_path, spec, message):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("abc" * 100)
    b.write_text("xyz" * 100)
    fill = {"a": a, "b": b, "tmp": tmp_path}
    with pytest.raises(BrigadeError) as refused:
        mix.parse(spec.format(**fill))
    assert message.format(**fill) in str(refused.value) and "\n" not in str(refused.value)


def test_texts_mix_in_one_vocabulary_each_split_as_one_text_would_be(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("ab" * 500)
    b.write_text("xy" * 500)
    vocab, train, val = load_text_data(f"{a}:3,{b}:1", 8, 0.1)
    assert vocab.chars == "abxy" and len(train) == 2 * (900 - 8) and len(val) == 2 * (100 - 8)
    x, _ = train.batch(torch.arange(400))
    from_a = sum(set(vocab.decode(row)) <= set("ab") for row in x)
    assert from_a == 300  # 3 : 1 in every cycle's prefix of 400
