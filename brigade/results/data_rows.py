"""docs/results.md's row for data at scale (results/data/, `data_scale`), rendered with the page's
rounding (`rows.Row`)."""

from __future__ import annotations

from brigade.results.rows import Row, adder

ROWS: list[Row] = []
row = adder(ROWS)


@row("data at scale: brigade tokenize on generated text of 10 MB, 100 MB and 1 GB (docs/hf.md's tiny "
     "Llama's byte-level tokenizer, 2 cores) against the tokenizers library's own batch-encode rate on the "
     "same text; then brigade train on each shard set (2 ranks): launch to first step and the largest "
     "process's peak memory; and a 100 MB text file given to --data as it is",
     "data/data_scale.json", "`python -m brigade.results.data_scale`")
def _data_scale(d: dict) -> str:
    tok = "; ".join(f"{r['corpus']} {r['tokenize']['tokens_per_s'] / 1e6:.2f} M tokens/s "
                    f"({100 * r['tokenize']['tokens_per_s'] / r['ceiling']['tokens_per_s']:.0f} % of the "
                    "library's)" for r in d["rows"])
    first = ", ".join(f"{r['train']['to_first_step_s']:.1f}" for r in d["rows"])
    rss = ", ".join(f"{r['train']['peak_rss_bytes'] / 2**20:.0f}" for r in d["rows"])
    u, s = d["unprepared"], d["summary"]
    return (f"tokenize {tok}; first step after {first} s (×{s['first_step_ratio']:.2f} from the "
            f"smallest to the largest); peak memory {rss} MiB (×{s['rss_ratio']:.2f}); --data "
            f"{u['corpus']} file: done in {u['train']['seconds']:.0f} s, peak "
            f"{u['train']['peak_rss_bytes'] / 2**20:.0f} MiB")
