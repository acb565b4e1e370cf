#!/usr/bin/env python3
"""Bit-for-bit fingerprints of what `brigade check` and `brigade train` compute, per layout.

Runs a fixed grid of small `brigade check --json`, `brigade train` and `brigade schedule --json`
commands, each as its own `python -m brigade ...` process in its own temporary folder (cases run
one after another), and writes one JSON object:

    {"_meta": {...}, "check/1f1b": {"cmd": ..., "rc": 0, "seconds": 8.1, "result": {...}}, ...}

Compared between two files (--compare): each case's "rc", "result" and "error". Floats are kept
as repr strings (exact: float(repr(x)) == x), so equal means bit-for-bit equal. "seconds",
"cmd", "info" (the memory event's peak bytes, which follow the threads' timing) and "_meta" are
informational and never compared.

  check     the whole `--json` object (loss, max_abs_{loss,grad,param}_diff, balance, V, ok, ...)
  schedule  the whole `brigade schedule --json` object of each schedule (every rank's actions)
  train     per step loss, grad_norm, lr (and fp16's loss_scale); every val_loss; the storage-byte
            counts of the "memory" event but its peak; the event names; the layout line train
            prints first; `brigade inspect --json` of the newest snapshot (params_sha256, step,
            layout, config_hash, files)

Standalone: stdlib only, and brigade only through its CLI, so it runs on any version of the tree:
a restructuring that must not change what brigade computes runs it on the tree before and after.

    # the tree on PYTHONPATH (its examples/llama.py is used too), or whatever `python -m brigade` finds
    git worktree add --detach ../before HEAD          # the tree before the change
    python scripts/fingerprints.py --tree ../before --out before.json
    python scripts/fingerprints.py --out after.json --compare before.json
    python scripts/fingerprints.py --from after.json --compare before.json    # two files, no run
    python scripts/fingerprints.py --list                                      # the case names
    python scripts/fingerprints.py --only train/pp2 --compare before.json     # a subset

The whole grid (77 cases) takes 9-14 minutes on 2 CPU cores.

Exit status: 0; with --compare, 1 if any compared case differs (or is missing on one side).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA = "{tree}/examples/llama.py:model"  # filled in with the tree under test

# ---------------------------------------------------------------------------------------------
# The grid. check: the CLI's GPT (GPTConfig(block_size=32), 6 blocks, tied head), batch 8;
# stages 2, micro-batches 4 and the schedule's own V unless a case says otherwise.

CHECK: list[tuple[str, list[str]]] = []


def _c(name: str, *flags: str) -> None:
    CHECK.append((f"check/{name}", list(flags)))


# every schedule of the registry (tests/check/test_run.py GRID), its default V
for _s in ("gpipe", "1f1b", "zb", "interleaved", "looped-bfs", "zbv", "dualpipev", "auto"):
    _c(_s, "--schedule", _s)
# the other V of the schedules that take any; other micro-batch counts (GRID's m in {1, 3, 8})
_c("interleaved-v1", "--schedule", "interleaved", "--virtual", "1")
_c("looped-bfs-v1", "--schedule", "looped-bfs", "--virtual", "1")
_c("auto-v1", "--schedule", "auto", "--virtual", "1")
_c("1f1b-m1", "--schedule", "1f1b", "--microbatches", "1")
_c("zb-m8", "--schedule", "zb", "--microbatches", "8")
_c("interleaved-m3", "--schedule", "interleaved", "--microbatches", "3")
# 4 pipeline ranks (llama's stages-4 grid, here on the GPT)
_c("stages4-1f1b", "--stages", "4", "--schedule", "1f1b")
# recompute (RECOMPUTE grid)
_c("recompute-full-1f1b", "--schedule", "1f1b", "--recompute", "full")
_c("recompute-full-zbv", "--schedule", "zbv", "--recompute", "full")
_c("recompute-selective-zb", "--schedule", "zb", "--recompute", "selective")
_c("recompute-selective-interleaved", "--schedule", "interleaved", "--recompute", "selective")
# dp 2 × pp 2, DDP (test_transparency_grid dp2)
_c("dp2-1f1b", "--dp", "2", "--schedule", "1f1b")
_c("dp2-zb", "--dp", "2", "--schedule", "zb")
_c("dp2-dualpipev", "--dp", "2", "--schedule", "dualpipev")
# dp 2 sharded (FSDP2) × pp 2 (test_transparency_grid shard2), and --reshard
_c("shard2-1f1b", "--dp", "2", "--shard", "2", "--schedule", "1f1b")
_c("shard2-zb", "--dp", "2", "--shard", "2", "--schedule", "zb")
_c("shard2-zbv", "--dp", "2", "--shard", "2", "--schedule", "zbv")
_c("reshard-zb", "--dp", "2", "--shard", "2", "--reshard", "--schedule", "zb")
_c("reshard-interleaved", "--dp", "2", "--shard", "2", "--reshard", "--schedule", "interleaved")
# HSDP 2 replicas × shard 2, one stage, m 2 (test_hsdp_two_replicas_of_two_shards_on_every_schedule)
_c("hsdp-dp4-shard2-1f1b", "--stages", "1", "--dp", "4", "--shard", "2", "--microbatches", "2",
   "--schedule", "1f1b")
_c("hsdp-dp4-shard2-zb", "--stages", "1", "--dp", "4", "--shard", "2", "--microbatches", "2",
   "--schedule", "zb")
# tensor parallel: tp 2 × pp 2 (TP_GRID), and dp 2 × tp 2 with one stage, m 2
_c("tp2-1f1b", "--tp", "2", "--schedule", "1f1b")
_c("tp2-zbv", "--tp", "2", "--schedule", "zbv")
_c("tp2-zb-recompute-full", "--tp", "2", "--schedule", "zb", "--recompute", "full")
_c("tp2-dp2-stages1-1f1b", "--tp", "2", "--dp", "2", "--stages", "1", "--microbatches", "2",
   "--schedule", "1f1b")
_c("tp2-dp2-stages1-zb", "--tp", "2", "--dp", "2", "--stages", "1", "--microbatches", "2",
   "--schedule", "zb")
# the local runtime: one process, one thread per stage; and dp 2 of those
_c("local-1f1b", "--runtime", "local", "--schedule", "1f1b")
_c("local-zb", "--runtime", "local", "--schedule", "zb")
_c("local-interleaved", "--runtime", "local", "--schedule", "interleaved")
_c("local-zbv", "--runtime", "local", "--schedule", "zbv")
_c("local-stages4-zb", "--runtime", "local", "--stages", "4", "--schedule", "zb")
_c("local-dp2-interleaved", "--runtime", "local", "--dp", "2", "--schedule", "interleaved")
_c("local-dp2-zbv", "--runtime", "local", "--dp", "2", "--schedule", "zbv")
# other models
_c("toy-1f1b", "--model", "toy", "--schedule", "1f1b")
_c("mlp-zbv", "--model", "mlp", "--schedule", "zbv")
_c("llama-1f1b", "--model", LLAMA, "--schedule", "1f1b")
_c("llama-zbv", "--model", LLAMA, "--schedule", "zbv")
_c("llama-local-interleaved", "--model", LLAMA, "--runtime", "local", "--schedule", "interleaved")
_c("llama-shard2-zb-selective", "--model", LLAMA, "--dp", "2", "--shard", "2", "--schedule", "zb",
   "--recompute", "selective", "--microbatches", "2")

# train: a tiny tied GPT with dropout (tests/e2e/test_exact_resume.py's RUN), 3 steps, a validation
# loss at steps 0 and 3, one snapshot at step 3.
TRAIN_BASE = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--context", "16", "--block-size", "16",
              "--batch-size", "8", "--microbatches", "2", "--dropout", "0.1", "--seed", "21",
              "--max-steps", "3", "--warmup-steps", "2", "--eval-every", "3", "--eval-batches", "2",
              "--snapshot-every", "3", "--sample-tokens", "0"]
TRAIN: list[tuple[str, list[str]]] = []


def _t(name: str, *flags: str) -> None:
    TRAIN.append((f"train/{name}", list(flags)))


_t("nproc1", "--nproc", "1")
_t("dp2", "--nproc", "2")
_t("dp2-grad-accum2", "--nproc", "2", "--grad-accum", "2")
for _s in ("1f1b", "zb", "interleaved", "zbv"):
    _t(f"pp2-{_s}", "--nproc", "2", "--pp", "2", "--schedule", _s)
# auto: planned on unit costs, then again on step 3's measured costs (the "plan" event after step 3);
# that order may follow the timings, the numbers must not (generate.py: every stage runs its
# micro-batches in order, so gradients accumulate in one order). 5 steps: 4 and 5 run the new plan.
AUTO = ["--schedule", "auto", "--microbatches", "4", "--max-steps", "5", "--eval-every", "5",
        "--snapshot-every", "5"]
_t("pp2-auto-m4", "--nproc", "2", "--pp", "2", *AUTO)
_t("local2-auto-m4", "--nproc", "1", "--local-stages", "2", *AUTO)
_t("dp2xpp2-dualpipev", "--nproc", "4", "--pp", "2", "--schedule", "dualpipev")
_t("shard2xpp2-1f1b", "--nproc", "4", "--pp", "2", "--shard", "2")
_t("shard2xpp2-zb", "--nproc", "4", "--pp", "2", "--shard", "2", "--schedule", "zb")
_t("hsdp-nproc4-shard2", "--nproc", "4", "--shard", "2")
_t("tp2xpp2-1f1b", "--nproc", "4", "--pp", "2", "--tp", "2")
_t("tp2xpp2-zbv", "--nproc", "4", "--pp", "2", "--tp", "2", "--schedule", "zbv")
_t("tp2", "--nproc", "2", "--tp", "2")
_t("local2", "--nproc", "1", "--local-stages", "2")
_t("dp2xlocal2-zbv", "--nproc", "2", "--local-stages", "2", "--schedule", "zbv")
_t("dp2xlocal2", "--nproc", "2", "--local-stages", "2")
_t("pp2-zb-recompute-full", "--nproc", "2", "--pp", "2", "--schedule", "zb", "--recompute", "full")
_t("pp2-bf16", "--nproc", "2", "--pp", "2", "--precision", "bf16")
_t("pp2-fp16", "--nproc", "2", "--pp", "2", "--precision", "fp16")

# schedule: each schedule's plan as `brigade schedule --json` draws it (its default 4 ranks, 8
# micro-batches, the schedule's own V): every rank's action order, bubble, makespan, peak held.
SCHEDULE = [(f"schedule/{s}", ["--schedule", s]) for s in
            ("gpipe", "1f1b", "zb", "interleaved", "looped-bfs", "zbv", "dualpipev", "auto")]

COMPARED = ("rc", "result", "error")

# ---------------------------------------------------------------------------------------------


def exact(x):
    """JSON value with every float as its repr string (bit-exact), recursively."""
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, dict):
        return {k: exact(v) for k, v in x.items()}
    if isinstance(x, list):
        return [exact(v) for v in x]
    return x


def _env(tree: str | None, keep_gpus: bool) -> dict:
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = tree + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if not keep_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU suite's setting (tests/conftest.py)
    env.setdefault("PYTHONHASHSEED", "0")
    return env


def _brigade(python: str, env: dict, args: list[str], cwd: str, timeout: float):
    return subprocess.run([python, "-m", "brigade", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _scrub(text: str, tmp: str) -> str:
    """Error text without what changes run to run: the temp folder, ports, pids, times."""
    text = text.replace(tmp, "<tmp>")
    text = re.sub(r"/tmp/[\w.\-/]+", "<path>", text)
    text = re.sub(r"\b(port|pid)\s*[=:]?\s*\d+", r"\1 <n>", text, flags=re.I)
    text = re.sub(r"\d+(\.\d+)?\s*s\b", "<t>s", text)
    return text


def _tail(text: str, n: int = 30) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def run_check_case(flags: list[str], python: str, env: dict, tmp: str, timeout: float,
                   command: str = "check") -> dict:
    """`brigade check` (or another command whose --json prints one object) and its object."""
    out = {"cmd": f"brigade {command} " + " ".join(flags) + " --json"}
    try:
        p = _brigade(python, env, [command, *flags, "--json"], tmp, timeout)
    except subprocess.TimeoutExpired:
        return {**out, "rc": None, "error": f"timeout after {timeout:g} s"}
    out["rc"] = p.returncode
    line = next((s for s in reversed(p.stdout.strip().splitlines()) if s.startswith("{")), None)
    if line is None:
        out["error"] = _scrub(_tail(p.stderr or p.stdout), tmp)
        return out
    out["result"] = exact(json.loads(line))
    if p.returncode not in (0, 1) or (p.returncode and command != "check"):  # check's 1: a mismatch
        out["error"] = _scrub(_tail(p.stderr), tmp)
    return out


def _metrics(path: Path) -> dict:
    steps, val, memory, peak, events = {}, {}, {}, {}, []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        s = str(r["step"])
        if "loss" in r:
            steps[s] = {k: r[k] for k in ("loss", "grad_norm", "lr", "loss_scale") if k in r}
        elif "val_loss" in r:
            val[s] = r["val_loss"]
        elif r.get("event") == "memory":  # "peak": from the profiler's allocation events, whose
            # order follows the threads' and collectives' timing under tp and local stages: not compared
            memory[s] = {k: v for k, v in r.items() if k not in ("time", "event", "step")
                         and not k.endswith("peak")}
            peak[s] = {k: v for k, v in r.items() if k.endswith("peak")}
        elif "event" in r:
            events.append(f'{s}:{r["event"]}')
    return exact({"steps": steps, "val_loss": val, "memory": memory, "events": events}), peak


def run_train_case(flags: list[str], python: str, env: dict, tmp: str, timeout: float) -> dict:
    run_dir = os.path.join(tmp, "run")
    args = ["train", "--out", run_dir, *TRAIN_BASE, *flags]
    out = {"cmd": "brigade train --out OUT " + " ".join(TRAIN_BASE + flags)}
    try:
        p = _brigade(python, env, args, tmp, timeout)
    except subprocess.TimeoutExpired:
        return {**out, "rc": None, "error": f"timeout after {timeout:g} s"}
    out["rc"] = p.returncode
    result: dict = {}
    first = p.stdout.strip().splitlines()[:1]
    if first:
        result["header"] = first[0].replace(run_dir, "<out>")
    metrics = Path(run_dir, "metrics.jsonl")
    if metrics.exists():
        numbers, peak = _metrics(metrics)
        result.update(numbers)
        out["info"] = {"memory_peak": peak}
    if p.returncode != 0:
        out["error"] = _scrub(_tail(p.stderr or p.stdout), tmp)
    elif Path(run_dir).is_dir():
        q = _brigade(python, env, ["inspect", run_dir, "--json"], tmp, timeout)
        if q.returncode == 0:
            info = json.loads(q.stdout.strip().splitlines()[-1])
            info.pop("path", None)
            result["snapshot"] = exact(info)
        else:
            out["error"] = "inspect: " + _scrub(_tail(q.stderr), tmp)
    out["result"] = result
    return out


def cases(tree: str) -> list[tuple[str, str, list[str]]]:
    """(kind, name, flags) of the whole grid, with the tree's llama path filled in."""
    fill = lambda flags: [f.format(tree=tree) if f == LLAMA else f for f in flags]  # noqa: E731
    return [("check", n, fill(f)) for n, f in CHECK] + [("train", n, fill(f)) for n, f in TRAIN] + \
        [("schedule", n, f) for n, f in SCHEDULE]


def probe(python: str, env: dict) -> dict:
    """Where `python -m brigade` comes from, under this environment, from a neutral folder."""
    code = ("import brigade, os, sys, torch; d = os.path.dirname(os.path.dirname(os.path.abspath("
            "brigade.__file__))); print(d); print(torch.__version__); print(sys.version.split()[0])")
    with tempfile.TemporaryDirectory() as tmp:
        p = subprocess.run([python, "-c", code], cwd=tmp, env=env, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"fingerprints: cannot import brigade: {p.stderr.strip()}")
    tree, torch_version, py = p.stdout.split()
    head = subprocess.run(["git", "-C", tree, "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)
    return {"tree": tree, "git_head": head.stdout.strip() or None,
            "git_dirty": bool(dirty.stdout.strip()) if dirty.returncode == 0 else None,
            "torch": torch_version, "python": py, "cpu_count": os.cpu_count()}


def compare(mine: dict, other: dict, only: str | None, label: tuple[str, str]) -> int:
    names = [n for n in dict.fromkeys([*other, *mine]) if n != "_meta" and (not only or only in n)]
    bad = 0
    for n in names:
        a, b = mine.get(n), other.get(n)
        if a is None or b is None:
            print(f"DIFF {n}: only in {label[0] if b is None else label[1]}")
            bad += 1
            continue
        diffs = _diff({k: a.get(k) for k in COMPARED}, {k: b.get(k) for k in COMPARED}, "")
        if diffs:
            bad += 1
            print(f"DIFF {n}  ({a.get('cmd')})")
            for path, x, y in diffs[:20]:
                print(f"    {path or '.'}: {label[0]} {x!r}  {label[1]} {y!r}")
            if len(diffs) > 20:
                print(f"    ... {len(diffs) - 20} more")
    print(f"fingerprints: {len(names) - bad} of {len(names)} cases equal, {bad} differ")
    return 1 if bad else 0


def _diff(a, b, path: str) -> list:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in dict.fromkeys([*a, *b]):
            out += _diff(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{path}.{k}" if path else k)
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [(path, a, b)]


def run_grid(a: argparse.Namespace, env: dict) -> dict:
    """Every case `a.only` selects, one after another, each in a temporary folder of its own."""
    meta = probe(a.python, env)
    if a.tree and os.path.realpath(meta["tree"]) != os.path.realpath(a.tree):
        sys.exit(f"fingerprints: --tree {a.tree} but brigade imports from {meta['tree']}")
    todo = [c for c in cases(meta["tree"]) if not a.only or a.only in c[1]]
    print(f"fingerprints: {len(todo)} cases of brigade from {meta['tree']} "
          f"(git {str(meta['git_head'])[:12]}{', dirty' if meta['git_dirty'] else ''})", flush=True)
    results: dict = {"_meta": meta}
    start = time.monotonic()
    for i, (kind, name, flags) in enumerate(todo, 1):
        tmp = tempfile.mkdtemp(prefix="fp-")
        t0 = time.monotonic()
        try:
            if kind == "train":
                r = run_train_case(flags, a.python, env, tmp, a.timeout)
            else:
                r = run_check_case(flags, a.python, env, tmp, a.timeout, command=kind)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        r["seconds"] = round(time.monotonic() - t0, 2)
        results[name] = r
        state = "ERROR" if "error" in r else f"rc {r['rc']}"
        print(f"[{i:2}/{len(todo)}] {name:40} {state:6} {r['seconds']:6.1f} s", flush=True)
        if "error" in r:
            print("      " + r["error"].replace("\n", "\n      "), flush=True)
    meta["seconds"] = round(time.monotonic() - start, 1)
    meta["only"] = a.only
    print(f"fingerprints: {len(todo)} cases in {meta['seconds']:.0f} s, "
          f"{sum('error' in results[n] for _, n, _ in todo)} errors", flush=True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the fingerprints JSON here")
    ap.add_argument("--only", help="run (and compare) only the cases whose name contains this")
    ap.add_argument("--compare", metavar="OTHER.json", help="print each case whose numbers differ "
                    "from OTHER.json; exit 1 if any do")
    ap.add_argument("--from", dest="source", metavar="FILE.json",
                    help="with --compare: compare this file instead of running the grid")
    ap.add_argument("--tree", help="put this source tree first on PYTHONPATH (default: whatever "
                    "`python -m brigade` imports in this environment)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter (default: this one)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per command (default: 300)")
    ap.add_argument("--keep-gpus", action="store_true",
                    help="leave CUDA_VISIBLE_DEVICES alone (default: hide GPUs, as the test suite does)")
    ap.add_argument("--list", action="store_true", help="print the case names and flags, run nothing")
    a = ap.parse_args()

    if a.source:
        if not a.compare:
            ap.error("--from needs --compare")
        mine = json.loads(Path(a.source).read_text())
        other = json.loads(Path(a.compare).read_text())
        return compare(mine, other, a.only, (a.source, a.compare))

    env = _env(os.path.abspath(a.tree) if a.tree else None, a.keep_gpus)
    if a.list:
        for kind, name, flags in cases(a.tree or "TREE"):
            print(f"{name:40} brigade {kind} {' '.join(flags)}")
        return 0
    results = run_grid(a, env)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
        print(f"fingerprints: wrote {a.out}")
    if a.compare:
        other = json.loads(Path(a.compare).read_text())
        return compare(results, other, a.only, ("this run", a.compare))
    return 0


if __name__ == "__main__":
    sys.exit(main())
