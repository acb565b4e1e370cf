"""Every command the README and the pages of docs/ show runs as written.

The commands are collected from the pages themselves (README.md, then docs/*.md in name order):
every command line in their code blocks and every command in their tables (`brigade …`, the
project's `python scripts/…`, `python -m brigade…`, `torchrun …`, `srun …`); one that several
pages show runs once.
Each runs as shown, shortened only by flags: a tiny model and few steps for `train`, small
sizes for `bench` and `tune`, a temporary `--out`. Placeholders become local values
(`node0:29500` and `HOST:PORT` a free loopback port, `/shared/run` and `runs/latest` a temporary
folder, `K` each node rank), `srun` becomes one process per task with Slurm's variables, and a
multi-node command runs once per node rank, side by side. A command added to any page that
does not work fails here.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from brigade.host.net import free_port
from tests.e2e.helpers import TINY

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]  # every page's commands run
PREFIXES = ("brigade ", "python -m brigade", "python scripts/", "torchrun ", "srun ",
            "scripts/setup.sh && ")

# Flags that shorten a command without changing what it shows.
_SMALL_SWEEP = ["--quick", "", "--repeats", "1", "--batch-size", "4", "--splits", "2", "--image-size", "16",
                "--schedules", "1f1b"]
def _pairs(args: list[str]) -> list[str]:
    """`args` as flag, value pairs, a switch (`--no-mfu`) paired with "" as SHORT writes one."""
    out, i = [], 0
    while i < len(args):
        value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
        out += [args[i], value if value is not None else ""]
        i += 1 if value is None else 2
    return out


SHORT = {
    "train": [*_pairs(TINY), "--max-steps", "4"],
    "bench": _SMALL_SWEEP,
    "tune": _SMALL_SWEEP,
    "plan": ["--recompute", "none"],  # one recompute mode measured instead of three (~25 s less each)
    # (and `TINY_GPT_PLAN` where the plan is of the built-in GPT at its default sizes)
    "brigade.results.speed": ["--repeats", "1"],
    "brigade.results.overhead": ["--tiny", "", "--steps", "2", "--rounds", "1", "--warmup", "1"],
    "brigade.results.plan_accuracy": ["--tiny", "", "--rounds", "1", "--steps", "4"],
    "brigade.results.cut_bound": ["--tiny", ""],
    "brigade.results.big_plans": ["--tiny", ""],
    "brigade.results.published": ["--tiny", ""],
    "brigade.results.long_context": ["--tiny", ""],  # 30 plans of an 8B at full size: 80-90 s
    "brigade.results.moe_plan": ["--tiny", ""],
    "brigade.results.experts": ["--tiny", "", "--steps", "4", "--rounds", "1"],
    "brigade.results.levers": ["--tiny", "", "--rounds", "1"],
    "brigade.results.data_scale": ["--tiny", ""],
    "brigade.results.context": ["--tiny", ""],
    "brigade.results.snapshot_stall": ["--tiny", ""],
    "brigade.results.kill_campaign": ["--tiny", ""],
    "brigade.results.head_loss": ["--tiny", ""],
    "brigade.results.lora": ["--tiny", ""],
    # its 21 runs (11 layouts) at full size took 6+ minutes on a slow day (bf16 steps are 6-9x fp32's on CPU)
    "brigade.results.footprint": ["--tiny", "", "--steps", "3", "--repeats", "2"],
}
# A plan of the built-in GPT that gives none of its sizes measures the default GPT on this CPU
# (45-60 s a plan, most of it timing its blocks): the test measures a tiny one, as `train` trains
# one; the plan's search, memory model and table are the same code whatever the sizes.
TINY_GPT_PLAN = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "32"]
# What a command is meant to do when it does not succeed (its page says so beside it).
# The GPU smoke test on a machine without one: its first check fails and it stops (exit 1).
EXPECTED_EXIT = [("stall:rank=", 1), ("gpu-check.sh", 0 if torch.cuda.is_available() else 1)]


def _commands_in_blocks(text: str) -> list[str]:
    """Lines of ```bash blocks, and lines typed after a `$ ` prompt in any block; a line of
    commands joined by ` && ` is each of them (but the set-up's, which the README's own test
    holds as it is: `_as_shown`)."""
    out, fence = [], None
    for line in text.splitlines():
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
            continue
        typed = line.strip().startswith("$ ")
        line = line.strip().removeprefix("$ ")
        if fence is not None and (fence in ("bash", "sh") or typed) and line.startswith(PREFIXES):
            line = line.split("  #")[0].split(" # ")[0].strip()
            parts = line.split(" && ")
            joined = len(parts) > 1 and not line.startswith("scripts/setup.sh && ") and \
                all(p.startswith(PREFIXES) for p in parts)
            out += parts if joined else [line]
    return out


def _commands_in_tables(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        if line.startswith("|"):
            out += [c for c in re.findall(r"`([^`]+)`", line) if c.startswith(PREFIXES)]
    return out


def page_commands(page: Path) -> list[str]:
    """The commands one page shows: its code blocks' first, then its tables'."""
    text = page.read_text(encoding="utf-8")
    return _commands_in_blocks(text) + _commands_in_tables(text)


def _as_shown(cmd: str) -> str:
    cmd = cmd.removeprefix("scripts/setup.sh && ")
    return re.sub(r"--node-rank \d+", "--node-rank K", cmd)  # node 0 and node 1: one case


def _case(cmd: str) -> str:
    """What running `cmd` here means, as one string: `brigade doctor [--nnodes 2 … HOST:PORT …]`
    runs here as plain `brigade doctor`, and a command that differs from another only in its
    --out folder (the default folder is every other command's) runs as that one."""
    return " ".join(re.sub(r" --out \S+", "", localise(cmd, Path("OUT"), 1)).split())


def readme_commands() -> list[str]:
    """Every distinct command the README and docs/ show, in order of appearance (README first),
    once per case; `python -m pytest …` is left to the suite itself."""
    once: dict[str, str] = {}
    for cmd in (_as_shown(c) for page in PAGES for c in page_commands(page)):
        if not cmd.startswith("python -m pytest"):
            once.setdefault(_case(cmd), cmd)
    return list(once.values())


def _optional_groups(cmd: str) -> str:
    """`[--json]` is part of the command; a group naming placeholders is left out."""
    def keep(m: re.Match) -> str:
        return "" if re.search(r"\b(K|HOST|PORT|DIR|V|D|S|T|C|MODE)\b", m[1]) else m[1]
    return re.sub(r"\[([^\]]*)\]", keep, cmd)


def localise(cmd: str, out: Path, port: int) -> str:
    cmd = _optional_groups(cmd).replace(" ...", "")
    cmd = re.sub(r"(node0|10\.213\.0\.1|HOST):(\d+|PORT)", f"127.0.0.1:{port}", cmd)
    cmd = re.sub(r"(/shared/runs?/\w*|/shared/run|runs/latest|\bDIR\b|\bOUT\b)", str(out), cmd)
    return cmd


def _subcommand(argv: list[str]) -> str:
    if "-m" in argv:
        mod = argv[argv.index("-m") + 1]
        return argv[argv.index("-m") + 2] if mod == "brigade" else mod
    return argv[1] if argv[0] == "brigade" else ""


def shorten(argv: list[str], out: Path) -> list[str]:
    sub = _subcommand(argv)
    flags = SHORT.get(sub, [])
    extra = []
    for flag, value in zip(flags[::2], flags[1::2]):
        if flag not in argv:  # a flag the command gives (its --max-steps, say) is part of what it shows
            extra += [flag, value] if value else [flag]
    model = argv[argv.index("--model") + 1] if "--model" in argv else "gpt"
    if sub == "plan" and model == "gpt" and "formula" not in argv and \
            not any(flag in argv for flag in TINY_GPT_PLAN[::2]):
        extra += TINY_GPT_PLAN
    fault = re.search(r"step=(\d+)", " ".join(argv))
    if sub == "train" and fault and "--max-steps" not in argv:  # run past the step the fault names
        extra[extra.index("--max-steps") + 1] = str(int(fault[1]) + 3)
    if sub in ("train", "bench", "tune", "brigade.results.speed", "brigade.results.overhead") \
            and "--out" not in argv and "--from" not in argv and "--help" not in argv:
        extra += ["--out", str(out)]
    if sub in ("bench", "tune") and "--ranks" in argv and "--batch-size" in extra:
        # two samples a rank: a data-parallel row of ResNet-50 on one sample a rank has nothing
        # for BatchNorm to normalise over
        extra[extra.index("--batch-size") + 1] = str(2 * int(argv[argv.index("--ranks") + 1]))
    return argv + extra


def _python(argv: list[str]) -> list[str]:
    """`brigade …` and `python …` as this interpreter runs them."""
    if argv[0] == "brigade":
        return [sys.executable, "-m", "brigade", *argv[1:]]
    if argv[0] in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    if argv[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    return argv


def _slurm(argv: list[str], port: int) -> list[tuple[list[str], dict]]:
    """`srun [-n N] CMD`: N tasks (multi-node.md's sbatch example: 2 nodes × 2 tasks)."""
    n = int(argv[argv.index("-n") + 1]) if "-n" in argv else 4
    cmd = argv[argv.index("python"):] if "python" in argv else argv[1:]
    base = {"SLURM_NTASKS": str(n), "SLURM_NTASKS_PER_NODE": str(n), "SLURM_JOB_NODELIST": "localhost",
            "SLURM_JOB_ID": "7", "MASTER_PORT": str(port)}
    return [(cmd, {**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}) for r in range(n)]


def processes(cmd: str, out: Path) -> list[tuple[list[str], dict]]:
    """The processes (argv, extra environment) that running `cmd` as shown means here."""
    port = free_port()
    argv = shorten(shlex.split(localise(cmd, out, port)), out)
    if argv[0].startswith("scripts/"):  # the project's own scripts, wherever the command runs
        argv[0] = str(ROOT / argv[0])
    if argv[0] == "python" and argv[1].startswith("scripts/"):
        argv[1] = str(ROOT / argv[1])
    if argv[0] == "srun":
        return [(_python(a), env) for a, env in _slurm(argv, port)]
    if "K" in argv:
        k = argv.index("K")
        return [(_python(argv[:k] + [str(r)] + argv[k + 1:]), {}) for r in (0, 1)]
    # torchrun's own default port (29500) is shared by every test running at once: give it a free
    # one through its environment (PET_MASTER_PORT), leaving the command as written.
    return [(_python(argv), {"PET_MASTER_PORT": str(port)} if argv[0] == "torchrun" else {})]


def run_all(procs: list[tuple[list[str], dict]], cwd: Path,
            timeout: float) -> list[subprocess.CompletedProcess]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE"))}
    running = [subprocess.Popen(a, cwd=cwd, env={**env, **e}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for a, e in procs]
    done = []
    for p, (a, _) in zip(running, procs):
        try:
            stdout, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in running:
                q.kill()
            raise AssertionError(f"{' '.join(a)} did not finish in {timeout:.0f} s") from None
        done.append(subprocess.CompletedProcess(a, p.returncode, stdout, ""))
    return done


COMMANDS = readme_commands()
README_COMMANDS = {_case(_as_shown(c)) for c in page_commands(README)}
# The slow tier's (`python -m pytest -m slow`): the benchmarks' and the tuner's commands, which
# measure (10-20 s each); and the commands that start several processes through another launcher
# (torchrun, srun) or on two nodes (K), 20-35 s each, which tests/e2e/test_train.py also runs (in
# the full tier), each way once, checking more.
BENCHMARKS = ("bench", "tune", "brigade.results.overhead", "brigade.results.speed",
              "brigade.results.footprint", "brigade.results.plan_accuracy", "brigade.results.cut_bound",
              "brigade.results.big_plans", "brigade.results.published", "brigade.results.levers", "brigade.results.data_scale",
              "brigade.results.moe_plan", "brigade.results.experts", "brigade.results.context",
              "brigade.results.snapshot_stall", "brigade.results.kill_campaign", "brigade.results.head_loss",
              "brigade.results.lora")
LAUNCHERS = ("torchrun", "srun")


def _param(cmd: str):
    """A command as a case, in its tier: slow (above); the default for the README's own commands,
    but a `brigade plan` that measures the model and this machine (40-100 s: all but `--costs
    formula`); the full tier (tests/tiers.py, which CI runs after the default) for the rest, the
    commands of docs/ and that `brigade plan`."""
    argv = shlex.split(cmd)
    # and what compiles (20-40 s a world) or converts to float8 (torchao): the slow tier's too
    if _subcommand(argv) in BENCHMARKS or argv[0] in LAUNCHERS or "K" in argv or \
            "--compile" in argv or "--float8" in argv:
        return pytest.param(cmd, marks=[pytest.mark.slow])
    measures = _subcommand(argv) == "plan" and "formula" not in argv
    full = _case(cmd) not in README_COMMANDS or measures
    return pytest.param(cmd, marks=[pytest.mark.full] if full else [])


def in_this_process(argv: list[str], cmd: str) -> bool:
    """Whether a command runs as `brigade.cli.main(ARGV)` in this process: a plain `brigade …` of
    one process that is meant to succeed. Its workers are forked from here as the agent forks
    them from a `brigade` process (with torch already imported, as there), so what is saved is
    the interpreter's start and the imports: 2-3 s a command. Whatever a page shows through
    another program (`torchrun`, `srun`, `python -m …`, the scripts), as several processes, or
    expecting a failure, runs as its own process."""
    return (argv[:3] == [sys.executable, "-m", "brigade"] and "K" not in shlex.split(cmd)
            and not any(pattern in cmd for pattern, _ in EXPECTED_EXIT))


def run_here(argv: list[str], cwd: Path, capfd, monkeypatch) -> subprocess.CompletedProcess:
    """`brigade ARGV` by the CLI's `main` in this process, in `cwd`, as `run_all` runs it."""
    from brigade.cli import main

    monkeypatch.chdir(cwd)
    for name in [k for k in os.environ if k.startswith(("SLURM_", "RANK", "WORLD_SIZE"))]:
        monkeypatch.delenv(name)
    capfd.readouterr()
    try:
        code = main(argv[3:])
    except SystemExit as exc:  # argparse's usage errors, as the real command exits
        code = exc.code
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(argv, code, out + err, "")


def test_the_readme_shows_commands():
    assert len(COMMANDS) >= 15, COMMANDS
    assert any(c.startswith("torchrun ") for c in COMMANDS) and any(c.startswith("srun ") for c in COMMANDS)
    setup = [c for c in page_commands(README) if c.startswith("scripts/setup.sh && ")]
    assert setup == ["scripts/setup.sh && brigade train", "scripts/setup.sh && python -m pytest"], setup


def test_every_page_of_docs_is_read_and_its_commands_run():
    names = {p.name for p in PAGES[1:]}
    assert {"layouts.md", "models.md", "multi-node.md", "results.md", "schedules.md"} <= names, names
    cases = {_case(c) for c in COMMANDS}
    for page in PAGES:
        for cmd in map(_as_shown, page_commands(page)):
            assert cmd.startswith("python -m pytest") or _case(cmd) in cases, f"{page.name}: {cmd}"
    # docs/ shows commands the README does not (the README is one screen): they run too.
    assert set(COMMANDS) - {_as_shown(c) for c in page_commands(README)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_run) -> Path:
    """A finished run, for the commands that read one (generate, plot, inspect): a copy of the
    session's tiny run (`brigade train` itself is one of the README's commands, tested below)."""
    out = tmp_path_factory.mktemp("latest") / "run"
    shutil.copytree(tiny_run, out)
    return out


HF_DIR, HF_RUN = "runs/tiny-llama", "runs/hf"  # docs/hf.md's directory and its fine-tune
MOE_DIR = "runs/tiny-qwen3-moe"  # docs/hf.md's mixture of experts
SHARDS = "runs/shards"  # docs/data.md's shard set, tokenized by docs/hf.md's directory


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory) -> Path:
    """A finished fine-tune of docs/hf.md's directory, made as that page makes it (relative
    paths, from its own folder), for the commands that read one (generate, export)."""
    from tests.e2e.helpers import brigade
    from tests.models.hf.dirs import tiny_dir

    where = tmp_path_factory.mktemp("hf")
    (where / "runs").mkdir()
    (where / HF_DIR).symlink_to(tiny_dir("llama"))
    done = brigade("train", "--model", f"hf:{HF_DIR}", "--data", README, *TINY, "--max-steps", "4",
                   "--out", HF_RUN, cwd=where)
    assert done.returncode == 0, done.stderr[-3000:]
    return where / HF_RUN


def _hf_directories(cmd: str, cwd: Path, request) -> None:
    """docs/hf.md's directory in `cwd` for a command that names it (but the one that writes
    it), and its fine-tune for one that reads it."""
    if "brigade.models.hf.tiny" in cmd:
        return
    from tests.models.hf.dirs import tiny_dir

    if MOE_DIR in cmd:
        (cwd / "runs").mkdir(exist_ok=True)
        (cwd / MOE_DIR).symlink_to(tiny_dir("qwen3_moe", layers=2))
    if HF_DIR not in cmd and HF_RUN not in cmd:
        return
    (cwd / "runs").mkdir(exist_ok=True)
    (cwd / HF_DIR).symlink_to(tiny_dir("llama"))
    if f"--from {HF_RUN}" in cmd:
        shutil.copytree(request.getfixturevalue("hf_run"), cwd / HF_RUN)
    if f"--data {SHARDS}" in cmd:  # the shard set the page's `brigade tokenize` writes
        from brigade.data.tokenize import TokenizeConfig, tokenize

        tokenize(TokenizeConfig(corpus=[str(README)], model=f"hf:{cwd / HF_DIR}", out=str(cwd / SHARDS)),
                 progress=False, say=lambda line: None)


@pytest.mark.timeout(640)
@pytest.mark.parametrize("cmd", [_param(c) for c in COMMANDS])
def test_readme_command_runs(cmd, tmp_path, trained, capfd, monkeypatch, request):
    reads_run = re.search(r"(runs/latest|\bOUT\b|--from)", cmd) and " train" not in cmd
    out = trained if reads_run else tmp_path / "out"
    for name in ("examples", "README.md", "docs"):  # the pages' commands run from the checkout
        (tmp_path / name).symlink_to(README.parent / name)
    _hf_directories(cmd, tmp_path, request)
    procs = processes(cmd, out)
    if len(procs) == 1 and not procs[0][1] and in_this_process(procs[0][0], cmd):
        results = [run_here(procs[0][0], tmp_path, capfd, monkeypatch)]
    else:
        # The footprint's 21 runs of 4 processes take 4 minutes even tiny: a benchmark gets 10.
        results = run_all(procs, tmp_path, 600 if _subcommand(shlex.split(cmd)) in BENCHMARKS else 360)
    expected = next((code for pattern, code in EXPECTED_EXIT if pattern in cmd), 0)
    for r in results:
        assert r.returncode == expected, f"{' '.join(r.args)} → exit {r.returncode}\n{r.stdout[-4000:]}"
        assert "Traceback" not in r.stdout, r.stdout[-4000:]
    _check_what_it_wrote(_subcommand(shlex.split(cmd)), results[0].stdout, tmp_path)


def _check_what_it_wrote(sub: str, stdout: str, cwd: Path) -> None:
    """A results script's JSON, where it says it wrote one (`wrote PATH.json …`): there, whole, and
    stamped with the script's own command; then, where its tests define `check_tiny(result)`
    (`tests/results/test_NAME.py`), what that asks of a tiny run's figures."""
    if not sub.startswith("brigade.results."):
        return
    import importlib

    name = sub.removeprefix("brigade.results.")
    try:
        check = getattr(importlib.import_module(f"tests.results.test_{name}"), "check_tiny", None)
    except ModuleNotFoundError:
        check = None
    written = [cwd / p for p in re.findall(r"\bwrote (\S+\.json)\b", stdout)]
    assert written or check is None, f"{sub} said it wrote no JSON:\n{stdout[-2000:]}"
    for plot in re.findall(r"\bwrote \S+\.json and (\S+\.png)", stdout):
        assert (cwd / plot).stat().st_size > 10_000, f"{plot}: a plot of nothing"
    for path in written:
        result = json.loads(path.read_text())
        assert "command" not in result or result["command"].startswith(f"python -m {sub}"), result["command"]
        if check is not None:
            check(result)


def test_localise_and_shorten(tmp_path):
    procs = processes("brigade train --nnodes 2 --node-rank K --rdzv-endpoint node0:29500 --out /shared/run",
                      tmp_path)
    assert [a[a.index("--node-rank") + 1] for a, _ in procs] == ["0", "1"]
    for argv, _ in procs:
        assert "node0:29500" not in " ".join(argv) and str(tmp_path) in argv and "--max-steps" in argv
    tasks = processes("srun -n 4 python -m brigade train --pp 2", tmp_path)
    assert [env["SLURM_PROCID"] for _, env in tasks] == ["0", "1", "2", "3"]
    (only,) = processes("brigade train --max-steps 300 --inject-fault kill:rank=1:step=150", tmp_path)
    assert only[0].count("--max-steps") == 1 and "300" in only[0]


def test_every_brigade_command_shown_parses(tmp_path):
    """Each `brigade …` a page shows, as it runs here, is one the CLI's parser accepts: a cheap
    default-tier guard for the docs' commands that only the full and slow tiers run (a table cell
    that quotes an error message starting `brigade eval:` once read as a command)."""
    from brigade.cli import build_parser

    parser = build_parser()
    for cmd in COMMANDS:
        argv = ["0" if a == "K" else a for a in shlex.split(localise(cmd, tmp_path, 29500))]
        argv = argv[3:] if argv[:3] == ["python", "-m", "brigade"] else \
            argv[1:] if argv[0] == "brigade" else None
        if argv is None:  # another program's command line (a script, torchrun, srun)
            continue
        try:
            parser.parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"{cmd!r} does not parse as shown (exit {exc.code})")
