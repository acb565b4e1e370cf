"""brigade against torchtitan on one GPU: the same Llama 3 model, settings and steps, side by side.

    python -m brigade.results.gpu_compare check DIR         both build the same model (any machine)
    python -m brigade.results.gpu_compare prepare DIR TEXT  the model's directory and the text (GPU)
    python -m brigade.results.gpu_compare run OUT --titan-python PY   the runs, then compare.json

scripts/gpu-compare.sh calls these in that order (the last two where a GPU is); docs/gpu.md. The
model and the check: brigade.results.gpu_compare_model; torchtitan's side: brigade.results.titan.
The runs: bf16 and compiled, then float8 (rowwise on both sides, the blocks' linear layers only),
sequence 2048, the same batch and steps, each side started by its own command line on the same
GPU, one after the other, brigade first.

What is compared, over the steps after the warm-up (`--warmup`, the compiler's steps among them):
    tokens_per_s     tokens trained ÷ wall time from the warm-up's last step to the last step, as
                     each side logs its steps (data loading and logging included, as torchtitan's
                     own figure counts them)
    mfu              tokens_per_s × (6·N + 12·L·T·d) FLOPs per token (brigade.results.gpu's
                     formula, which is torchtitan's for a tied model) ÷ the GPU's dense bf16 peak,
                     float8 too; so its ratio is tokens_per_s's (torchtitan's own: `own_mfu`)
    peak_memory_gib  the most GPU memory in use during the run less what was in use before it
                     (nvidia-smi every 200 ms): one ruler for both, CUDA context included. Each
                     side's own figure is kept too (`own_peak_gib`, `own_peak` says which)
Ratios are brigade ÷ torchtitan: above 1 is brigade faster (tokens, MFU) or hungrier (memory).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from brigade.errors import BrigadeError
from brigade.fsutil import write_atomic
from brigade.results import script, titan
from brigade.results.gpu import flops_per_token, peak_flops
from brigade.results.gpu_compare_model import SHAPE, brigade_model, check, write_model, write_text

FLOAT8_CAPABILITY = (8, 9)  # float8 matmuls: Ada, Hopper and later
JSON = "results/gpu/compare.json"
SIDES = ("brigade", "torchtitan")
# Everything either side reads is on this machine: offline, neither waits on a network a GPU box may lack.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def brigade_argv(mode: str, model_dir: Path, data: Path, steps: int, batch: int, out: Path,
                 seq_len: int = titan.SEQ_LEN) -> list[str]:
    """`brigade train` for one run (after the Python to use): one process, compiled, bf16, and
    float8 (the recipe torchtitan runs) for the float8 run; no sample, one evaluation batch."""
    argv = ["-m", "brigade", "train", "--model", f"hf:{model_dir}", "--data", str(data), "--nproc", "1",
            "--block-size", str(seq_len), "--batch-size", str(batch), "--max-steps", str(steps),
            "--precision", "bf16", "--compile", "--eval-every", str(steps), "--eval-batches", "1",
            "--sample-tokens", "0", "--snapshot-every", "0", "--keep", "1", "--out", str(out)]
    return argv + (["--float8", titan.RECIPE] if mode == "float8" else [])


class DeviceMemory:
    """Context manager: the most memory in use on GPU `gpu` (nvidia-smi's name for it) while it is
    open, less what was in use when it opened, sampled every 200 ms; `peak_gib` is None where
    nvidia-smi is missing."""

    def __init__(self, gpu: str):
        self.gpu, self.samples, self.base, self._proc = gpu, [], None, None

    def _query(self, *extra: str) -> list[str]:
        return ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", self.gpu,
                *extra]

    def __enter__(self) -> DeviceMemory:
        if shutil.which("nvidia-smi") is None:
            return self
        now = subprocess.run(self._query(), capture_output=True, text=True)
        if now.returncode != 0 or not now.stdout.strip().isdigit():  # a name it does not know (MIG)
            return self
        self.base = int(now.stdout)
        self._proc = subprocess.Popen(self._query("-lms", "200"), stdout=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            if line.strip().isdigit():
                self.samples.append(int(line))

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            time.sleep(0.5)  # the last samples
            self._proc.terminate()
            self._reader.join(timeout=10)

    @property
    def peak_gib(self) -> float | None:
        return None if self.base is None or not self.samples else (max(self.samples) - self.base) / 1024


def brigade_figures(run: Path, warmup: int) -> dict:
    """A finished `brigade train` run's figures (module doc), from its metrics.jsonl.

    Raises:
        BrigadeError: fewer than two steps from the warm-up's last on (nothing to time).
    """
    from brigade.train.metrics import events, read_records, training

    records = read_records(run)
    steps = training(records)
    window = [r for r in steps if r["step"] >= warmup]  # the warm-up's last step starts the clock
    if len(window) < 2:
        raise BrigadeError(f"{run}: {len(steps)} steps logged, too few to time after a warm-up of {warmup}")
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in window[1:])
    memory = events(records, "memory")
    return {"tokens_per_s": tokens / (window[-1]["time"] - window[0]["time"]), "steps_timed": len(window) - 1,
            "own_peak_gib": memory[0]["rank0/peak"] / 2**30 if memory else None,
            "own_peak": "the allocator's peak allocated during step 2", "own_mfu": None,
            "final_loss": steps[-1]["loss"]}


def titan_figures(log: str, warmup: int) -> dict:
    """A finished torchtitan run's figures (module doc), from the lines its trainer logged. Its
    tokens/s of a step counts the time since the line before: their harmonic mean over the steps
    after the warm-up is tokens ÷ time, as brigade's figure is.

    Raises:
        BrigadeError: no step logged after the warm-up.
    """
    steps = titan.read_log(log)
    window = [s for s in steps if s["step"] > warmup]
    if not window:
        raise BrigadeError(f"torchtitan logged {len(steps)} steps, none to time after a warm-up of {warmup}")
    mfus = [s["mfu"] for s in window]
    return {"tokens_per_s": len(window) / sum(1 / s["tokens_per_s"] for s in window),
            "steps_timed": len(window), "own_peak_gib": max(s["reserved_gib"] for s in steps),
            "own_peak": "the allocator's peak reserved, the largest of a step",
            "own_mfu": None if None in mfus else sum(mfus) / len(mfus), "final_loss": steps[-1]["loss"]}


def gpu() -> dict:
    """This machine's first GPU as torch sees it, asked in a child process, so that this one holds
    no CUDA context (it would sit in the memory the runs are measured by).

    Raises:
        BrigadeError: torch sees no GPU.
    """
    code = ("import json, torch; p = torch.cuda.get_device_properties(0); print(json.dumps({'name': p.name, "
            "'capability': [p.major, p.minor], 'memory_gib': p.total_memory / 2**30, "
            "'torch': torch.__version__, 'cuda': torch.version.cuda}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise BrigadeError(f"no GPU is visible to torch ({why}): the comparison runs where CUDA is")
    return json.loads(done.stdout.strip().splitlines()[-1])


def one_side(argv: list[str], log: Path, read, device: str) -> dict:
    """Run one side's command, its output in `log`, and read its figures (`read(log)`), with the
    memory it held; a failed run is its exit code and last line, and where its log is."""
    print(f"  $ {' '.join(argv)}", flush=True)
    start = time.monotonic()
    with DeviceMemory(device) as memory, open(log, "w", encoding="utf-8") as out:
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, **OFFLINE}).returncode
    print(f"    exit {code} after {time.monotonic() - start:.0f} s; its output: {log}", flush=True)
    if code != 0:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
        return {"error": f"exit {code}: {(lines or [''])[-1][:300]}", "log": str(log)}
    try:
        figures = read(log)
    except BrigadeError as exc:
        return {"error": str(exc), "log": str(log)}
    return {**figures, "peak_memory_gib": memory.peak_gib, "log": str(log)}


def side_by_side(ours: dict, theirs: dict, params: int, peak: float | None) -> dict:
    """Both sides' figures with MFU added, and brigade ÷ torchtitan of each (None where one is missing)."""
    per_token = flops_per_token(params, SHAPE["n_layers"], titan.SEQ_LEN, SHAPE["dim"])
    for side in (ours, theirs):
        if "tokens_per_s" in side:
            side["mfu"] = per_token * side["tokens_per_s"] / peak if peak else None

    def ratio(key: str) -> float | None:
        a, b = ours.get(key), theirs.get(key)
        return a / b if a is not None and b else None

    return {"brigade": ours, "torchtitan": theirs,
            "ratio": {key: ratio(key) for key in ("tokens_per_s", "mfu", "peak_memory_gib")}}


def compare(out: Path, titan_python: str, steps: int, warmup: int, batch: int) -> dict:
    """Both sides' bf16 runs, then their float8 runs (where the GPU has float8 matmuls), on the model
    and text `prepare` wrote to OUT/model and OUT/text: what compare.json holds."""
    device = gpu()
    model, data = out / "model", out / "text" / "train.jsonl"
    shape, params = brigade_model(model)
    if shape != SHAPE:
        raise BrigadeError(f"{model} holds another model than the comparison's: write it again with "
                           f"`python -m brigade.results.gpu_compare prepare {model} {data.parent}`")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0] or "0"  # torch's cuda:0
    runs = {}
    for mode in titan.MODES:
        if mode == "float8" and tuple(device["capability"]) < FLOAT8_CAPABILITY:
            have = ".".join(map(str, device["capability"]))
            runs[mode] = {"skipped": f"float8 matmuls need compute capability 8.9 or more; this GPU: {have}"}
            continue
        print(f"{mode}:", flush=True)
        run = out / f"brigade-{mode}"
        ours = one_side([sys.executable, *brigade_argv(mode, model, data, steps, batch, run)],
                        out / f"brigade-{mode}.log", lambda _, run=run: brigade_figures(run, warmup), visible)
        shutil.rmtree(run / "snapshots", ignore_errors=True)  # 15 GB at 1 B parameters, read by nothing
        flags = titan.flags(steps, batch, str(model), str(data.parent), str(out / f"torchtitan-{mode}"))
        theirs = one_side([titan_python, *titan.argv(mode, flags)], out / f"torchtitan-{mode}.log",
                          lambda log: titan_figures(log.read_text(errors="replace"), warmup), visible)
        runs[mode] = side_by_side(ours, theirs, params, peak_flops(device["name"]))
    return {"device": device, "torchtitan": titan.VERSION, "brigade_commit": _commit(),
            "date": time.strftime("%Y-%m-%d"), "model": {**SHAPE, "params": params, "flavor": titan.FLAVOR},
            "settings": {"seq_len": titan.SEQ_LEN, "batch": batch, "steps": steps, "warmup": warmup,
                         "compile": True, "precision": "bf16", "float8": titan.RECIPE},
            "runs": runs}


def _commit() -> str | None:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent)
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def _number(value: float | None, form: str) -> str:
    return "-" if value is None else format(value, form)


def summary(result: dict) -> list[str]:
    """compare.json in a few lines: per run, each figure of both sides and their ratio."""
    lines = []
    for mode, run in result["runs"].items():
        if "skipped" in run:
            lines.append(f"{mode}: not run: {run['skipped']}")
            continue
        lines += [f"{mode}: {side} failed: {run[side]['error']} (see {run[side]['log']})"
                  for side in SIDES if "error" in run[side]]
        b, t, r = run["brigade"], run["torchtitan"], run["ratio"]
        tps, mfu, mem = "tokens_per_s", "mfu", "peak_memory_gib"
        lines.append(f"{mode}: brigade vs torchtitan: tokens/s/GPU {_number(b.get(tps), ',.0f')} vs "
                     f"{_number(t.get(tps), ',.0f')} (x{_number(r[tps], '.3f')}), "
                     f"MFU {_number(b.get(mfu), '.1%')} vs {_number(t.get(mfu), '.1%')}, "
                     f"peak memory {_number(b.get(mem), '.1f')} vs {_number(t.get(mem), '.1f')} GiB "
                     f"(x{_number(r[mem], '.3f')})")
    return lines


def failed(result: dict) -> bool:
    """Whether a run of either side failed (a skipped run has not)."""
    return any("error" in run.get(side, {}) for run in result["runs"].values() for side in SIDES)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m brigade.results.gpu_compare",
                                description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("check", help="write DIR/config.json; both sides build the same model (any machine)")
    c.add_argument("dir")
    w = sub.add_parser("prepare", help="the model's directory (random weights) and the text (GPU)")
    w.add_argument("dir")
    w.add_argument("text")
    r = sub.add_parser("run", help="both sides' runs on OUT/model and OUT/text, then the JSON (GPU)")
    r.add_argument("out")
    r.add_argument("--titan-python", required=True, help="the Python that has torchtitan installed")
    r.add_argument("--json", default=JSON, help=f"where the result goes (default: {JSON})")
    for sized in (c, r):  # the check reads the runs' sizes too, to refuse them before any run
        sized.add_argument("--warmup", type=int, default=10, help="steps not timed (default: 10)")
        sized.add_argument("--steps", type=int, default=40, help="optimizer steps a run (default: 40)")
        sized.add_argument("--batch", type=int, default=4, help="sequences a step (default: 4)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.what != "prepare" and (args.batch < 1 or not 1 <= args.warmup < args.steps - 1):
        sizes = f"--steps {args.steps}, --batch {args.batch}, --warmup {args.warmup}"
        raise BrigadeError(f"{sizes}: need a batch of 1 or more and 1 <= warmup < steps - 1, so that two "
                           "steps or more are timed")
    if args.what == "check":
        print("\n".join(check(Path(args.dir), args.steps, args.batch)))
        return 0
    if args.what == "prepare":
        print(f"wrote {write_model(Path(args.dir))} and {write_text(Path(args.text))}")
        return 0
    result = compare(Path(args.out), args.titan_python, args.steps, args.warmup, args.batch)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(Path(args.json), json.dumps(result, indent=1) + "\n")
    print("\n".join([*summary(result), f"wrote {args.json}"]))
    return 1 if failed(result) else 0


if __name__ == "__main__":
    script.run(main, "brigade.results.gpu_compare")
