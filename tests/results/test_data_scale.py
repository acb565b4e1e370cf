"""brigade.results.data_scale: its corpora, its summary, and its row of docs/results.md."""

from brigade.results import data_scale
from brigade.results.data_rows import _data_scale


def test_a_corpus_has_the_size_asked_and_is_the_same_each_time(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    data_scale.write_corpus(a, 123_456)
    data_scale.write_corpus(b, 123_456)
    assert a.stat().st_size == 123_456 and a.read_bytes() == b.read_bytes()
    a.read_bytes().decode()  # UTF-8 throughout (passages are cut at line ends)
    data_scale.write_corpus(b, 123_456, seed=1)
    assert a.read_bytes() != b.read_bytes()


def _row(name, first, rss, rate=2e6, ceiling=4e6):
    return {"corpus": name, "tokenize": {"tokens_per_s": rate}, "ceiling": {"tokens_per_s": ceiling},
            "train": {"to_first_step_s": first, "peak_rss_bytes": rss, "seconds": 10.0}}


def test_the_summary_compares_the_largest_corpus_with_the_smallest():
    rows = [_row("10 MB", 10.0, 400 * 2**20), _row("1 GB", 11.0, 420 * 2**20)]
    s = data_scale.summary(rows)
    assert abs(s["first_step_ratio"] - 1.1) < 1e-12 and abs(s["rss_ratio"] - 1.05) < 1e-12
    assert s["tokenize_of_ceiling"] == [0.5, 0.5] and abs(s["max_rss_gib"] - 420 / 1024) < 1e-12
    result = {"rows": rows, "unprepared": {"corpus": "100 MB", "train": rows[0]["train"]}, "summary": s}
    assert _data_scale(result) == (
        "tokenize 10 MB 2.00 M tokens/s (50 % of the library's); 1 GB 2.00 M tokens/s (50 % of the "
        "library's); first step after 10.0, 11.0 s (×1.10 from the smallest to the largest); peak memory "
        "400, 420 MiB (×1.05); --data 100 MB file: done in 10 s, peak 400 MiB")
