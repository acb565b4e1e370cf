"""Data at scale: tokenizing corpora of 10 MB, 100 MB and 1 GB, and training on their shards.

    python -m brigade.results.data_scale --out results/data     (about 15 minutes on 2 cores; ~4 GB in --work)
    python -m brigade.results.data_scale --tiny --out /tmp/d    (tests this script)

Corpora: text made of random passages of CPython's documentation topics (the built-in corpus,
cut at line ends, drawn with a fixed seed), written into `--work` (a temporary folder by
default), never into the repository.

Tokenization: `brigade tokenize CORPUS --model hf:DIR` (DIR: docs/hf.md's tiny Llama, a
byte-level tokenizer) in a process of its own: wall seconds, tokens a second, its peak resident
memory. The ceiling: the `tokenizers` library's own `encode_batch_fast` on the same text, in
the same batches, the ids dropped (its rate with nothing else to do; on the first 100 MB of a
larger corpus).

Training: `brigade train --model hf:DIR --data SHARDS --nproc 2 --max-steps 3` on each shard
set: seconds from launch to the first step's record, and the peak resident memory of the
largest process (each rank and the launcher: the children's high-water mark). And once an
unprepared file: `--data FILE.txt` of 100 MB, tokenized into the run's cache by the run itself.

The goals: time to the first step and memory per rank flat in corpus size (1 GB within 1.2×
of 10 MB), under 1 GB per rank.
"""

from __future__ import annotations

import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from brigade.errors import RunError
from brigade.results import script

SIZES = {"10 MB": 10 * 10**6, "100 MB": 100 * 10**6, "1 GB": 10**9}
TINY_SIZES = {"100 kB": 10**5, "300 kB": 3 * 10**5}
CEILING_BYTES = 100 * 10**6  # the library's rate is measured on at most this much of a corpus
TRAIN = ["--nproc", "2", "--max-steps", "3", "--block-size", "64", "--batch-size", "8",
         "--eval-every", "1000", "--eval-batches", "1", "--sample-tokens", "0", "--snapshot-every", "0"]


def write_corpus(path: Path, size: int, seed: int = 0) -> None:
    """`size` bytes of text: passages of the built-in corpus, 2–40 lines each, in random order."""
    from brigade.data.text import default_corpus

    lines = default_corpus().encode().splitlines(keepends=True)
    rng, written = random.Random(seed), 0
    with open(path, "wb") as f:
        while written < size:
            start = rng.randrange(len(lines))
            passage = b"".join(lines[start: start + rng.randint(2, 40)])[: size - written]
            f.write(passage)
            written += len(passage)


def in_own_process(argv: list[str]) -> tuple[float, int, str]:
    """Run `argv` as a child of a fresh Python: (wall seconds, peak RSS in bytes of the largest
    process under it, its stdout). Raises RunError when it fails."""
    probe = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
             "done = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "print(done.stdout, file=sys.stderr if done.returncode else sys.stdout); "
             "print(done.stderr[-3000:], file=sys.stderr); "
             "print('PROBE', time.perf_counter() - t, "
             "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); "
             "sys.exit(done.returncode)")
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True)
    if done.returncode:
        raise RunError(f"{' '.join(argv[:4])}... failed: {done.stderr.strip().splitlines()[-1:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("PROBE "))
    _, seconds, rss = line.split()
    return float(seconds), int(rss), done.stdout


def ceiling(corpus: Path, directory: str) -> dict:
    """The tokenizers library's own rate on the corpus's first CEILING_BYTES, in the batches
    `brigade tokenize` makes, timed around the library's calls alone."""
    from brigade.data import corpus as reading
    from brigade.data import tokenize
    from brigade.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(directory)
    source = reading.Source(corpus, "text")
    read = [0]
    pieces = reading.read_pieces(source, "text", lambda n: read.__setitem__(0, read[0] + n))
    tokens, seconds = 0, 0.0
    for batch in tokenize._batches(pieces):
        t = time.perf_counter()
        tokens += sum(len(e.ids) for e in tokenizer.encode_batch_fast([p.text for p in batch],
                                                                      add_special_tokens=False))
        seconds += time.perf_counter() - t
        if read[0] >= CEILING_BYTES:
            break
    return {"bytes": read[0], "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def tokenize_row(corpus: Path, directory: str, shards: Path) -> dict:
    """`brigade tokenize` in a process of its own: its seconds (the ones it reports, without the
    process's start), tokens a second, peak RSS."""
    wall, rss, out = in_own_process([sys.executable, "-m", "brigade", "tokenize", str(corpus),
                                     "--model", f"hf:{directory}", "--out", str(shards)])
    seconds = float(re.search(r"\(([0-9.]+) s\)", out)[1])
    tokens = json.loads((shards / "manifest.json").read_text())["tokens"]
    return {"seconds": seconds, "process_seconds": wall, "tokens": tokens,
            "tokens_per_s": tokens / seconds, "peak_rss_bytes": rss}


def train_row(data: Path, directory: str, out: Path, repeats: int = 3) -> dict:
    """`brigade train` on `data` (a shard set, or a file it tokenizes itself), `repeats` times in
    new folders: the median seconds from launch to the first step's record, and the largest
    peak RSS of its largest process."""
    firsts, walls, rss = [], [], 0
    for k in range(repeats):
        launched = time.time()
        wall, peak, _ = in_own_process([sys.executable, "-m", "brigade", "train", "--model",
                                     f"hf:{directory}", "--data", str(data), "--out", f"{out}-{k}", *TRAIN])
        rows = [json.loads(line) for line in Path(f"{out}-{k}", "metrics.jsonl").read_text().splitlines()]
        firsts.append(next(r for r in rows if r.get("event") == "first_step")["time"] - launched)
        rss, walls = max(rss, peak), walls + [wall]
    return {"to_first_step_s": statistics.median(firsts), "to_first_step_each_s": firsts,
            "seconds": statistics.median(walls), "peak_rss_bytes": rss}


def run_sizes(sizes: dict, work: Path, directory: str, repeats: int = 3) -> list[dict]:
    """Per corpus size: tokenize it, the tokenizer's own ceiling on it, and `repeats` runs on its
    shards."""
    rows = []
    for name, size in sizes.items():
        corpus = work / f"corpus-{size}.txt"
        if not corpus.is_file() or corpus.stat().st_size != size:
            write_corpus(corpus, size)
        print(f"[{name}] tokenize", flush=True)
        row = {"corpus": name, "bytes": size,
               "tokenize": tokenize_row(corpus, directory, work / f"shards-{size}"),
               "ceiling": ceiling(corpus, directory)}
        print(f"[{name}] train on the shards", flush=True)
        row["train"] = train_row(work / f"shards-{size}", directory, work / f"run-{size}", repeats)
        rows.append(row)
        print(f"[{name}] {json.dumps(row)}", flush=True)
    return rows


def summary(rows: list[dict]) -> dict:
    small, big = rows[0]["train"], rows[-1]["train"]
    return {"first_step_ratio": big["to_first_step_s"] / small["to_first_step_s"],
            "rss_ratio": big["peak_rss_bytes"] / small["peak_rss_bytes"],
            "max_rss_gib": max(r["train"]["peak_rss_bytes"] for r in rows) / 2**30,
            "tokenize_of_ceiling": [r["tokenize"]["tokens_per_s"] / r["ceiling"]["tokens_per_s"]
                                    for r in rows]}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["corpus"] for r in rows]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.8))
    x = range(len(rows))
    a.bar([i - 0.2 for i in x], [r["tokenize"]["tokens_per_s"] / 1e6 for r in rows], 0.4,
          label="brigade tokenize")
    a.bar([i + 0.2 for i in x], [r["ceiling"]["tokens_per_s"] / 1e6 for r in rows], 0.4,
          label="tokenizers' encode_batch_fast (ceiling)")
    a.set(xticks=list(x), xticklabels=names, ylabel="million tokens / s (2 cores)", title="tokenization")
    a.legend(fontsize=8, loc="lower right")
    b.plot(names, [r["train"]["to_first_step_s"] for r in rows], "o-")
    b.set(ylabel="seconds", title="launch → first step (2 ranks)", ylim=(0, None))
    c.plot(names, [r["train"]["peak_rss_bytes"] / 2**20 for r in rows], "o-", label="on shards")
    if result.get("unprepared"):
        u = result["unprepared"]
        c.plot([u["corpus"]], [u["train"]["peak_rss_bytes"] / 2**20], "s",
               label="--data FILE (tokenized by the run)")
    top = max([r["train"]["peak_rss_bytes"] for r in rows]
              + [result.get("unprepared", {}).get("train", {}).get("peak_rss_bytes", 0)]) / 2**20
    c.set(ylabel="MiB", title="peak resident memory, largest process", ylim=(0, top * 1.15))
    c.legend(fontsize=8)
    script.close(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = script.parser("python -m brigade.results.data_scale", __doc__, "results/data",
                      "data_scale.json and data_scale.png", "corpora of 100 and 300 kB: tests the script")
    p.add_argument("--work", default="", help="folder for the generated corpora and shards "
                                               "(default: a temporary one, removed after)")
    args = p.parse_args(argv)
    from brigade.models.hf.tiny import write as write_tiny

    with tempfile.TemporaryDirectory(prefix="brigade-data-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        directory = str(work / "tiny-llama")
        if not (work / "tiny-llama" / "tokenizer.json").is_file():
            write_tiny(directory, "llama", 4)
        sizes = TINY_SIZES if args.tiny else SIZES
        rows = run_sizes(sizes, work, directory, repeats=1 if args.tiny else 3)  # tiny: one run a size
        name, size = list(sizes.items())[min(1, len(sizes) - 1)]
        print(f"[{name}] train on the unprepared file", flush=True)
        unprepared = {"corpus": name, "train": train_row(work / f"corpus-{size}.txt", directory,
                                                         work / f"run-file-{size}", repeats=1)}
        result = {"rows": rows, "unprepared": unprepared, "summary": summary(rows),
                  "command": "python -m brigade.results.data_scale" + (" --tiny" if args.tiny else "")}
        script.save(result, args.out, "data_scale", plot)
    return 0


if __name__ == "__main__":
    script.run(main, "brigade.results.data_scale")
