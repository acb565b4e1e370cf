"""Peak memory of the head's loss, plain against chunked: vocabulary 128 256, a sequence of 4096,
one sample, fp32, on this machine's CPU (bytes of resident memory).

    python -m brigade.results.head_loss --out results/head-loss   (about 5 minutes on 2 cores)
    python -m brigade.results.head_loss --tiny --out /tmp/h        (tests this script)

The head is the GPT's (`models.gpt.Head`: a final LayerNorm and an untied output layer) at hidden
size 1024: a Llama 3's 4096 would only add its weight and that weight's gradient (2 GiB each in
fp32) to both sides alike, and four times the matmuls to this 2-core machine's minutes; what the
chunks change, the logits (T × V) and their gradient, does not depend on it. Each row runs in a
process of its own, one thread: the head's input (1, T, C) with a gradient, then the loss's
forward and backward, plain (the head's logits whole, then `gpt_loss`) or chunked
(`parallel.chunked`, at each chunk size). Its figure is the peak resident memory during that
forward and backward less what the process held just before (Linux's VmHWM, reset first through
/proc/self/clear_refs): the logits, their softmax and gradients, and the gradients of the weight
and the input. The losses of every row are written too: equal within 1e-5.
"""

from __future__ import annotations

import gc
import multiprocessing
import time
from pathlib import Path

from brigade.errors import RunError
from brigade.results import script

SIZES = {"vocab": 128_256, "seq": 4096, "hidden": 1024, "chunks": [0, 2048, 1024, 512]}
TINY = {"vocab": 4096, "seq": 256, "hidden": 64, "chunks": [0, 128, 64]}


def _status(key: str) -> int:
    """A /proc/self/status figure (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RunError(f"/proc/self/status has no {key}: this measures on Linux only")


def _reset_peak() -> None:
    """VmHWM set back to the current resident memory (Linux ≥ 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def measure(vocab: int, seq: int, hidden: int, chunk: int) -> dict:
    """One row, in this process: the head's loss forward and backward, plain (`chunk` 0) or
    chunked; its peak resident bytes over what was held before, its seconds and its loss."""
    import torch
    from torch import nn

    from brigade.models.gpt import GPTConfig, Head, gpt_loss
    from brigade.parallel import chunked

    torch.set_num_threads(1)
    torch.manual_seed(0)
    head = Head(GPTConfig(vocab_size=vocab, n_embd=hidden, block_size=seq, tie_embeddings=False))
    x = torch.randn(1, seq, hidden, requires_grad=True)
    y = torch.randint(vocab, (1, seq))
    run, loss_fn = head, gpt_loss
    if chunk:
        run = nn.Sequential(head)
        c = chunked.install(run, head, chunk, "on")
        c.on = True
        loss_fn = c.loss(gpt_loss)
    warm = x[:, :16].detach().requires_grad_()  # the kernels' first calls (their own memory) here
    loss_fn(run(warm), y[:, :16]).backward()
    head.zero_grad(set_to_none=True)
    del warm
    gc.collect()
    before = _status("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    loss = loss_fn(run(x), y)
    loss.backward()
    loss = loss.detach()
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    return {"chunk": chunk, "peak_bytes": peak - before, "seconds": seconds, "loss": loss.item()}


def _row(args: tuple, queue) -> None:
    try:
        queue.put(measure(*args))
    except BaseException as exc:  # noqa: BLE001 -- reported to the parent as one line
        queue.put({"error": f"{type(exc).__name__}: {exc}"})


def measure_apart(vocab: int, seq: int, hidden: int, chunk: int) -> dict:
    """`measure` in a fresh process (spawned: nothing the parent allocated counts)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_row, args=((vocab, seq, hidden, chunk), queue))
    proc.start()
    got = queue.get()
    proc.join()
    if "error" in got:
        raise RunError(f"head loss at chunk {chunk}: {got['error']}")
    return got


def experiment(sizes: dict) -> dict:
    """Every row of `sizes` (plain first), and the figures the docs quote."""
    rows = []
    for chunk in sizes["chunks"]:
        rows.append(measure_apart(sizes["vocab"], sizes["seq"], sizes["hidden"], chunk))
        print(f"chunk {chunk or 'plain'}: {rows[-1]['peak_bytes']:,} bytes, {rows[-1]['seconds']:.1f} s",
              flush=True)
    plain = rows[0]
    for r in rows:
        r["ratio"] = r["peak_bytes"] / plain["peak_bytes"]
        r["slowdown"] = r["seconds"] / plain["seconds"]
    worst = max(abs(r["loss"] - plain["loss"]) for r in rows)
    if worst > 1e-5:
        raise RunError(f"the chunked losses differ from the plain one by {worst:.2e} (> 1e-5)")
    return {"vocab": sizes["vocab"], "seq": sizes["seq"], "hidden": sizes["hidden"], "batch": 1,
            "dtype": "float32", "threads": 1, "logits_bytes": 4 * sizes["seq"] * sizes["vocab"],
            "max_abs_loss_diff": worst, "rows": rows}


def plot(result: dict, path: Path) -> None:
    """The peak per row, in GiB, each bar with its seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    names = ["plain" if r["chunk"] == 0 else f"chunks of {r['chunk']}" for r in rows]
    gib = [r["peak_bytes"] / 2**30 for r in rows]
    ax.bar(names, gib, color=["#c44e52"] + ["#55a868"] * (len(rows) - 1))
    for i, r in enumerate(rows):
        ax.text(i, gib[i], f"{gib[i]:.2f} GiB\n{r['seconds']:.0f} s", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("peak resident memory of the loss's forward + backward (GiB)")
    ax.set_ylim(0, max(gib) * 1.2)
    ax.set_title(f"the head's loss: V = {result['vocab']:,}, T = {result['seq']}, C = {result['hidden']}, "
                 "fp32, CPU", fontsize=9)
    script.close(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = script.parser("python -m brigade.results.head_loss", __doc__, "results/head-loss",
                      "head_loss.json and head_loss.png", "V 4096, T 256, C 64")
    args = p.parse_args(argv)
    result = experiment(TINY if args.tiny else SIZES)
    script.save(result, args.out, "head_loss", plot)
    return 0


if __name__ == "__main__":
    script.run(main, "python -m brigade.results.head_loss")
