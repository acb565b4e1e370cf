"""The GPU speed levers on this CPU: fused AdamW against foreach, each block compiled against
eager, float8 against bf16; and whether they change what a model learns.

    python -m brigade.results.levers --out results/levers        (about 10 minutes on 2 cores)
    python -m brigade.results.levers --tiny --out /tmp/l         (tests this script)

Speed: the GPT (4 blocks of 256, context 64, batch 16) trained by `brigade train` on one process
of one thread, each lever on and off in turn, `--rounds` times interleaved (the machine drifts:
a lever's two sides are timed minutes apart at most); a row is the median over rounds of each
side's median step after the first 5 steps (compile's first steps wait for the compiler).
float8 goes through torchao (`pip install 'brigade[float8]'`), and runs where the blocks'
linear layers' dimensions are multiples of 16.

The split backward: one stage of the GPT's blocks, its input pass (I) and weight pass (W) timed
apart, eager and compiled (a compiled block's weight gradients come with its I).

Learning: 200 steps of examples/llama.py under bf16, bf16 + compile and float8 (tensorwise); the
final losses should lie within 2 % of each other.

What a CPU cannot show: torch.compile's gains come mostly from fusing a GPU's many small kernels
(launch- and memory-bound) and float8's from a GPU's float8 tensor cores; a CPU core runs each
op at once and has no float8 units (`torch._scaled_mm` on a CPU is emulated). The ratios here
say that each lever runs and what it costs or gains on a CPU, not what it does on a GPU:
scripts/gpu-compare.sh is the measurement for that.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from brigade.errors import BrigadeError, RunError
from brigade.results import script
from brigade.train.metrics import read_records, training, validation

GPT = ["--model", "gpt", "--n-layer", "4", "--n-embd", "256", "--n-head", "4", "--context", "64",
       "--block-size", "64", "--batch-size", "16"]
GPT_TINY = ["--model", "gpt", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--context", "32",
            "--block-size", "32", "--batch-size", "8"]
ONE = ["--nproc", "1", "--eval-every", "1000", "--eval-batches", "1", "--sample-tokens", "0",
       "--warmup-steps", "2", "--snapshot-every", "0", "--keep", "1"]
# (lever, its "off" flags, its "on" flags)
LEVERS = [
    ("fused AdamW", ["--adamw", "foreach"], ["--adamw", "fused"]),
    ("compile", [], ["--compile"]),
    ("float8 tensorwise", ["--precision", "bf16"], ["--precision", "bf16", "--float8", "tensorwise"]),
]
LLAMA = ["--model", "examples/llama.py:model", "--batch-size", "16"]
CURVES = {"bf16": ["--precision", "bf16"], "bf16 + compile": ["--precision", "bf16", "--compile"],
          "float8": ["--precision", "bf16", "--float8", "tensorwise"]}
SKIP = 5  # steps left out of a step-time median: compile's waits for the compiler


def train(args: list[str], steps: int) -> list[dict]:
    """`brigade train` with `args` for `steps` steps; its training records and its last validation."""
    with tempfile.TemporaryDirectory(prefix="brigade-levers-") as tmp:
        argv = [sys.executable, "-m", "brigade", "train", "--out", tmp, *args, "--max-steps", str(steps)]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
            raise RunError(f"brigade train {' '.join(args)}: exit {done.returncode}: {tail}")
        recs = read_records(Path(tmp))
    return training(recs) + validation(recs)


def _median_step(records: list[dict]) -> float:
    return statistics.median(r["step_time_s"] for r in records if r.get("step", 0) > SKIP
                             and "step_time_s" in r)


def speed(model: list[str], steps: int, rounds: int) -> list[dict]:
    """Per lever: each round's off and on median step, and the median of the rounds' ratios."""
    rows = []
    for name, off, on in LEVERS:
        pairs = [(_median_step(train([*model, *ONE, *off], steps)),
                  _median_step(train([*model, *ONE, *on], steps))) for _ in range(rounds)]
        rows.append({"lever": name, "off_flags": off, "on_flags": on,
                     "off_step_s": [a for a, _ in pairs], "on_step_s": [b for _, b in pairs],
                     "speedup": statistics.median(a / b for a, b in pairs)})
    return rows


def split_backward(tiny: bool, repeats: int = 5) -> dict:
    """The split backward (zb's I then W) of one stage of the GPT's blocks, eager and compiled:
    the medians of the forward, the input pass and the weight pass (ms). A compiled block's
    backward is one graph, so its W comes with its I (`runtime.backward`)."""
    import torch

    from brigade.parallel import compiled
    from brigade.pipeline.runtime.backward import backward_split
    from brigade.results.footprint import _gpt_blocks

    out, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)  # one thread, as each training process here
    for name in ("eager", "compiled"):
        blocks, d, t = _gpt_blocks(tiny)
        if name == "compiled":
            compiled.compile_blocks(blocks, list(range(len(blocks))), ["none"] * len(blocks))
        stage = torch.nn.Sequential(*blocks)
        times: dict[str, list[float]] = {"forward_ms": [], "input_ms": [], "weight_ms": []}
        for _ in range(repeats + 2):  # two warm-ups: the compiler's, and a first run
            h = torch.randn(8, t, d, requires_grad=True)
            marks = [time.perf_counter()]
            y = stage(h)
            marks.append(time.perf_counter())
            _, weights = backward_split(y.square().mean(), None, h, list(stage.parameters()))
            marks.append(time.perf_counter())
            weights(None)
            marks.append(time.perf_counter())
            for key, a, b in zip(times, marks, marks[1:]):
                times[key].append((b - a) * 1e3)
        out[name] = {k: statistics.median(v[2:]) for k, v in times.items()}
    torch.set_num_threads(threads)
    return out


def curves(steps: int, settings: tuple[str, ...] = tuple(CURVES)) -> dict:
    """Per setting, examples/llama.py's training loss at every step and its validation loss at
    the end (the same 8 held-out batches for every setting: the figure compared); and the spread
    of those final losses, (largest - smallest) / smallest."""
    out = {}
    for name in settings:
        flags = CURVES[name]
        recs = train([*LLAMA, "--nproc", "1", "--eval-every", str(steps), "--sample-tokens", "0",
                      "--snapshot-every", "0", "--keep", "1", *flags], steps)
        out[name] = {"flags": flags, "loss": [r["loss"] for r in recs if "loss" in r],
                     "val_loss": [r["val_loss"] for r in recs if "val_loss" in r][-1]}
    finals = [c["val_loss"] for c in out.values()]
    return {"steps": steps, "settings": out, "final_spread": (max(finals) - min(finals)) / min(finals)}


def plot(result: dict, path: Path) -> None:
    """Left: each lever's speed-up here (on ÷ off step time, > 1 faster); right: the loss curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    rows = result["speed"]
    a.barh([r["lever"] for r in rows], [r["speedup"] for r in rows], color="tab:blue")
    a.axvline(1.0, color="gray", lw=1, ls="--")
    a.set_xlabel("step time off ÷ on (> 1: the lever is faster), this CPU")
    a.set_title("GPT 4×256, one process")
    for name, c in result["curves"]["settings"].items():
        b.plot(range(1, len(c["loss"]) + 1), c["loss"], lw=1, label=f"{name} (val {c['val_loss']:.3f})")
    b.set_xlabel("step")
    b.set_ylabel("training loss")
    b.set_title(f"examples/llama.py: final spread {100 * result['curves']['final_spread']:.1f} %")
    b.legend()
    script.close(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = script.parser("python -m brigade.results.levers", __doc__, "results/levers",
                      "levers.json and levers.png", "a tiny GPT, few steps: tests the script")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each lever's two sides (≥ 1)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        raise BrigadeError(f"--rounds {args.rounds}: need at least 1")
    steps, curve_steps = (SKIP + 3, 4) if args.tiny else (30, 200)
    result = {"speed": speed(GPT_TINY if args.tiny else GPT, steps, args.rounds),
              "split_backward": split_backward(args.tiny),
              # tiny: the compiled curve left out (the speed rows compile already: 20-40 s each)
              "curves": curves(curve_steps, ("bf16", "float8") if args.tiny else tuple(CURVES)),
              "steps": steps, "rounds": args.rounds,
              "command": "python -m brigade.results.levers" + (" --tiny" if args.tiny else "")}
    script.save(result, args.out, "levers", plot)
    return 0


if __name__ == "__main__":
    script.run(main, "brigade.results.levers")
