"""brigade.results.cut_bound: every cut of the blocks is tried, the least lower bound is found, and
the script writes its JSON and plot. (Its docs command runs, `--tiny`, in tests/e2e/test_readme.py.)"""

import json
import math

from brigade.pipeline.plans.bounds import lower_bound
from brigade.pipeline.plans.schedule import build
from brigade.results.cut_bound import WITHIN, best_cut, cuts, main


def test_every_contiguous_cut_into_non_empty_stages_is_listed_once():
    assert list(cuts(4, 2)) == [[1, 3], [2, 2], [3, 1]]
    assert list(cuts(3, 3)) == [[1, 1, 1]]
    got = list(cuts(10, 4))
    assert len(got) == math.comb(9, 3) == len({tuple(c) for c in got})
    assert all(sum(c) == 10 and min(c) >= 1 for c in got)


def test_the_least_lower_bound_is_the_even_cut_of_equal_blocks():
    # four blocks of F 1, B 2 (I 1, W 1); p 2, m 4: balanced 4 · 12 / 2 = 24; the cut [2, 2] holds
    # rank 1 back by stage 0's forward (2) before its 4 · 6: 26; [1, 3] and [3, 1] are longer
    block = (1.0, 2.0, 1.0, 1.0)
    least, cut, tried = best_cut([block] * 4, build("1f1b", 2, 4))
    assert (least, cut, tried) == (26.0, [2, 2], 3)


def test_an_uneven_block_moves_the_best_cut_and_no_cut_is_shorter():
    costs = [(1.0, 2.0, 1.0, 1.0), (4.0, 8.0, 4.0, 4.0), (1.0, 2.0, 1.0, 1.0), (1.0, 2.0, 1.0, 1.0),
             (1.0, 2.0, 1.0, 1.0)]
    plan = build("zbv", 2, 4, 2)
    least, cut, tried = best_cut(costs, plan)
    assert tried == math.comb(4, 3) and sum(cut) == 5
    for other in cuts(5, 4):
        ends = [0, *[sum(other[: k + 1]) for k in range(4)]]
        per = [[sum(c[j] for c in costs[a:b]) for a, b in zip(ends, ends[1:])] for j in range(4)]
        assert lower_bound(plan, per[0], per[1], weight=per[2], input_grad=per[3]) >= least


def test_the_tiny_run_writes_its_rows_and_plot(tmp_path):
    assert main(["--tiny", "--out", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "bound.json").read_text())
    assert {(r["virtual"], r["placement"]) for r in got["rows"]} == {(1, "single"), (2, "loop"), (2, "v")}
    for r in got["rows"]:
        assert r["least_lower_bound_s"] >= r["balanced_bound_s"] > 0
        assert r["within"] == (r["ratio"] <= 1 + WITHIN) and sum(r["best_cut"]) == r["blocks"]
    assert (tmp_path / "bound.png").stat().st_size > 0
