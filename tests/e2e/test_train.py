"""`brigade train` end to end: what a user runs and what they get.

Training runs as a user starts it; reading its results (inspect, generate, plot) runs `brigade`
in this process (the `cli` fixture, tests/conftest.py), since test_readme runs those commands
as a user does.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import TINY, brigade, final_hash, inspect, losses, train

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="session")  # not module: xdist interleaves modules, which tears it down
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    result = train(out, "--max-steps", "20", "--snapshot-every", "10", "--mfu")
    assert result.returncode == 0, result.stderr
    return out, result


def test_outputs_of_a_run(run_dir):
    out, result = run_dir
    assert "results in" in result.stdout and "--- sample ---" in result.stdout
    assert "validation loss" in result.stdout
    for name in ("metrics.jsonl", "config.toml", "loss.png", "sample.txt", "snapshots/LATEST"):
        assert (out / name).exists(), name
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 21))
    assert {"step", "loss", "lr", "tokens_per_s", "step_time_s", "mfu", "tflops"} <= set(steps[0])
    assert all(0 < r["mfu"] < 1 for r in steps)  # held to this CPU's cores, measured at the start
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(vals) == 3 and vals[-1] < vals[0]
    (memory,) = [r for r in rows if r.get("event") == "memory"]  # once, every rank's, on step 2
    assert memory["step"] == 2 and memory["counted"] == "storages"
    for rank in (0, 1):
        kinds = {k: memory[f"rank{rank}/{k}"]
                 for k in ("params", "grads", "optimizer", "activations", "peak")}
        assert kinds["params"] == kinds["grads"] > 0 and kinds["optimizer"] > 2 * kinds["params"]
        assert kinds["peak"] > kinds["params"] + kinds["grads"] + kinds["optimizer"] > 0
    assert (out / "snapshots" / "LATEST").read_text() == "step_00000020"
    assert sorted(p.name for p in (out / "snapshots").iterdir()) == ["LATEST", "step_00000010",
                                                                     "step_00000020"]


def test_config_file_reproduces_the_run(run_dir, tmp_path):
    out, _ = run_dir
    text = (out / "config.toml").read_text()
    assert "max_steps = 20" in text
    again = brigade("train", "--config", out / "config.toml", "--out", tmp_path / "again")
    assert again.returncode == 0, again.stderr
    assert final_hash(tmp_path / "again") == final_hash(out)  # deterministic for a seed


def test_generate_plot_inspect(run_dir, cli):
    out, _ = run_dir
    gen = cli("generate", "--from", out, "--prompt", "def ", "--tokens", "30")
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("def ") and len(gen.stdout.rstrip("\n")) == 34
    (out / "loss.png").unlink()
    plot = cli("plot", out)
    assert plot.returncode == 0 and (out / "loss.png").is_file()
    info = inspect(out)
    assert info["step"] == 20
    assert info["layout"] == {"dp": 2, "pp": 1, "local_stages": 1, "virtual": 1, "tp": 1, "cp": 1}
    assert len(info["params_sha256"]) == 64 and info["checksums"] == "ok"


def test_plot_of_an_unfinished_run(tmp_path, cli):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0, "lr": 0.1}\n{"step": 2, "lo')
    assert cli("plot", tmp_path).returncode == 0 and (tmp_path / "loss.png").is_file()


def _layout(out) -> dict:
    return inspect(out)["layout"]


RUN_FOLDER = ("config.toml", "metrics.jsonl", "snapshots/LATEST", "loss.png", "sample.txt")


def assert_whole_run_folder(out: Path, stdout: str, ranks: int) -> None:
    """What brigade's own launcher leaves, whoever started the processes: the files, the console's
    start and done lines (once: rank 0's), and every rank's stderr under logs/."""
    for name in RUN_FOLDER:
        assert (out / name).exists(), f"{name} missing from {sorted(p.name for p in out.iterdir())}"
    assert stdout.count("brigade: training gpt on 4 processes (dp=2 × pp=2") == 1, stdout
    assert stdout.count("brigade: done at step 3") == 1 and "--- sample ---" in stdout, stdout
    logs = sorted(out.glob("logs/*/attempt_0/*/stderr.log"))
    assert [p.parent.name for p in logs] == [str(r) for r in range(ranks)], logs
    from brigade.config import load_toml

    assert load_toml(out / "config.toml")["parallel"]["pp"] == 2  # `brigade train --config` reads it


@pytest.mark.full
def test_a_longer_resume_goes_on_with_the_decay_end_it_is_given(tiny_run, tmp_path):
    """The 6-step run resumed to step 9: --decay-steps 6 keeps its cosine's end (the added steps
    at --min-lr), --decay-steps 9 stretches what is left of it to the new end."""
    import shutil

    rates = {}
    for end in (6, 9):
        out = tmp_path / f"end{end}"
        shutil.copytree(tiny_run, out)
        result = train(out, "--max-steps", "9", "--decay-steps", str(end), "--sample-tokens", "0")
        assert result.returncode == 0, result.stderr
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        rates[end] = {r["step"]: r["lr"] for r in rows if "lr" in r}
    assert rates[6][6] == rates[9][6]  # the first 6 steps are the snapshot's run, as it was
    assert [rates[6][s] for s in (7, 8, 9)] == pytest.approx([3e-4] * 3)  # --min-lr from the end on
    from brigade.config import OptimConfig
    from brigade.train.optimizer import lr_at

    stretched = OptimConfig(warmup_steps=5, decay_steps=9)  # TINY's warm-up; --lr, --min-lr defaults
    assert [rates[9][s] for s in (7, 8, 9)] == pytest.approx([lr_at(s - 1, stretched, 9) for s in (7, 8, 9)])
    assert rates[9][7] > rates[9][8] > rates[9][9] > 3e-4


@pytest.mark.full
def test_a_held_out_text_is_validated_on_and_all_of_data_trains(tmp_path):
    """--val-data: the training losses do not depend on which text is held out (it is never
    trained on), the validation losses do; and without it --data's last tenth is held out, so the
    run trains on other windows."""
    from brigade.data.text import default_corpus

    corpus = default_corpus()
    (tmp_path / "train.txt").write_text(corpus[:30000])
    (tmp_path / "a.txt").write_text(corpus[30000:33000])
    (tmp_path / "b.txt").write_text(corpus[:30000][-3000:])  # text the run also trains on
    runs = {}
    for name, extra in (("a", ["--val-data", str(tmp_path / "a.txt")]),
                        ("b", ["--val-data", str(tmp_path / "b.txt")]), ("split", [])):
        out = tmp_path / name
        result = train(out, "--data", str(tmp_path / "train.txt"), "--max-steps", "6", "--eval-every", "3",
                       "--sample-tokens", "0", *extra)
        assert result.returncode == 0, result.stderr
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[name] = losses(out), [r["val_loss"] for r in rows if "val_loss" in r]
    assert runs["a"][0] == runs["b"][0] != runs["split"][0]
    assert runs["a"][1] != runs["b"][1]


@pytest.mark.full
def test_a_mixture_of_texts_resumes_under_another_layout_on_the_same_samples(tmp_path):
    """--data a:3,b:1: a run stopped at step 3 on two replicas and resumed on one process reads
    the samples the uninterrupted run reads at every step (the mixture is a pure function of the
    global cursor); its decay's end kept with --decay-steps across the longer resume."""
    from brigade.data.text import default_corpus

    corpus = default_corpus()
    (tmp_path / "a.txt").write_text(corpus[:20000])
    (tmp_path / "b.txt").write_text(corpus[40000:50000])
    mixture = ["--data", f"{tmp_path / 'a.txt'}:3,{tmp_path / 'b.txt'}:1", "--sample-tokens", "0",
               "--snapshot-every", "3"]
    whole, moved = tmp_path / "whole", tmp_path / "moved"
    assert train(whole, *mixture, "--max-steps", "6", "--nproc", "2").returncode == 0
    assert train(moved, *mixture, "--max-steps", "3", "--decay-steps", "6", "--nproc", "2").returncode == 0
    done = train(moved, *mixture, "--max-steps", "6", "--decay-steps", "6", "--nproc", "1")
    assert done.returncode == 0 and "resuming from snapshot step 3" in done.stdout, done.stderr

    def samples(out):
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["samples"] for r in rows if "samples" in r}

    assert samples(moved) == samples(whole) and sorted(samples(whole)) == list(range(1, 7))


@pytest.mark.full
def test_the_metrics_go_to_wandb_and_mlflow_too(tmp_path, monkeypatch):
    """`--log wandb,mlflow` offline, as CI can: W&B writes its run (the id the run kept) for a
    later `wandb sync`, MLflow's file store holds every step's loss as metrics.jsonl does."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks it of a file store's readers
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "tracked"
    result = train(out, "--max-steps", "6", "--log", "wandb,mlflow", "--sample-tokens", "0", "--nproc", "2")
    assert result.returncode == 0, result.stderr
    run_id = (out / "wandb-run-id").read_text().strip()
    assert list(out.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    client = MlflowClient((out / "mlruns").resolve().as_uri())
    history = client.get_metric_history((out / "mlflow-run-id").read_text().strip(), "train/loss")
    assert {m.step: m.value for m in history} == losses(out)


def test_runs_under_torchrun(tmp_path):
    """torchrun's world decides: 4 processes with --pp 2 is dp 2 × pp 2 (brigade's --nproc is 2);
    with no brigade parent process, rank 0 writes the run folder and prints what it would."""
    from brigade.host.net import free_port

    out = tmp_path / "tr"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
           str(free_port()), "-m", "brigade", "train", "--out", str(out), *TINY, "--pp", "2",
           "--max-steps", "3"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert max(losses(out).values()) > 0 and len(losses(out)) == 3
    assert _layout(out) == {"dp": 2, "pp": 2, "local_stages": 1, "virtual": 1, "tp": 1, "cp": 1}
    assert_whole_run_folder(out, result.stdout, ranks=4)


def test_runs_under_slurm_variables(tmp_path):
    """Four tasks as `srun -n 4 python -m brigade train --pp 2` starts them: SLURM_* only; with
    the interleaved schedule, two stages per pipeline rank (V = 2, its own)."""
    from brigade.host.net import free_port

    port = str(free_port())
    out = tmp_path / "slurm"
    procs = []
    for rank in range(4):
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="4", SLURM_LOCALID=str(rank),
                   SLURM_NTASKS_PER_NODE="4", SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="7",
                   MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "brigade", "train", "--out", str(out), *TINY, "--max-steps", "3",
             "--pp", "2", "--schedule", "interleaved"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    printed = ""
    for p in procs:
        text, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-2000:]
        printed += text
    assert len(losses(out)) == 3
    assert _layout(out) == {"dp": 2, "pp": 2, "local_stages": 1, "virtual": 2, "tp": 1, "cp": 1}
    assert_whole_run_folder(out, printed, ranks=4)
    assert list((out / "logs").iterdir()) == [out / "logs" / "slurm-7"]  # the job's id names the run


def _train_from_python(out: str) -> dict:
    """A user's own function under `brigade.launch`: the run's config, then `brigade.train.run.run`."""
    from brigade.cli import build_parser
    from brigade.config import build
    from brigade.launcher.env import launcher_world
    from brigade.train.run import run

    args = build_parser().parse_args(["train", "--out", out, *TINY, "--pp", "2", "--max-steps", "3"])
    return run(build(args, world=launcher_world()))


def test_runs_under_brigade_launch_from_python(tmp_path, capfd):
    """`brigade.launch(fn, nproc=4)` where fn runs the training: the same folder and lines."""
    import brigade

    out = tmp_path / "py"
    results = brigade.launch(_train_from_python, 4, str(out))
    assert sorted(results) == [0, 1, 2, 3] and results[0][0]["step"] == 3
    assert_whole_run_folder(out, capfd.readouterr().out, ranks=4)


def _wait_until_listening(port: int, seconds: float = 60) -> None:
    import socket

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port} after {seconds} s")


def test_two_torchrun_agents_on_loopback(tmp_path):
    """`torchrun --nnodes 2 --rdzv-backend c10d`, 2 processes each: dp 2 × pp 2 from the world of 4."""
    from brigade.host.net import free_port

    port = free_port()
    out = tmp_path / "agents"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "brigade", "train",
           "--out", str(out), *TINY, "--pp", "2", "--max-steps", "3", "--sample-tokens", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    _wait_until_listening(port)  # the first agent hosts the rendezvous store
    agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for agent in agents:
        _, err = agent.communicate(timeout=240)
        assert agent.returncode == 0, err[-2000:]
    assert len(losses(out)) == 3
    assert _layout(out) == {"dp": 2, "pp": 2, "local_stages": 1, "virtual": 1, "tp": 1, "cp": 1}


def test_python_api_example_from_readme(tmp_path):
    """The README's Python example, run as a user would copy it."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    code = readme.split("<!-- python-api -->")[1].split("```python")[1].split("```")[0]
    script = tmp_path / "example.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "final loss" in result.stdout


def test_two_node_agents_on_loopback(tmp_path):
    """Two `brigade train` agents, --nnodes 2, meeting at one endpoint on loopback; global rank 0
    on node 1. c10d ranks the agents by (address, pid): node 1's process starts first (the lower
    pid) and waits for node 0's store before it runs brigade, so node 0 holds no rank 0 and must
    still finish the run (plot, sample) and exit 0.
    """
    from brigade.host.net import free_port

    port = free_port()
    out = tmp_path / "nodes"
    common = ["train", "--out", str(out), *TINY, "--nnodes", "2", "--nproc", "1", "--pp", "2",
              "--max-steps", "4", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    late = (f"import sys; from tests.e2e.test_train import _wait_until_listening; "
            f"_wait_until_listening({port}); from brigade.cli import main; sys.exit(main(sys.argv[1:]))")
    node1 = subprocess.Popen([sys.executable, "-c", late, *common, "--node-rank", "1"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=Path(__file__).parents[2])
    node0 = subprocess.Popen([sys.executable, "-m", "brigade", *common, "--node-rank", "0"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert node1.pid < node0.pid  # (pids wrapped around: the case below is not the one meant)
    out0, err0 = node0.communicate(timeout=240)
    _, err1 = node1.communicate(timeout=240)
    assert node0.returncode == 0, err0[-2000:]
    assert node1.returncode == 0, err1[-2000:]
    assert "brigade: done at step 4" in out0 and (out / "loss.png").is_file()
    assert (out / "sample.txt").read_text()
    assert len(losses(out)) == 4
    assert _layout(out)["pp"] == 2


def _tree(root: int) -> set[int]:
    """`root` and every process below it (Linux /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    tree, grew = {root}, True
    while grew:
        grew = False
        for pid, ppid in parents.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return tree


@pytest.mark.skipif(sys.platform != "linux" or subprocess.run(["which", "ss"], capture_output=True)
                    .returncode != 0, reason="needs Linux and iproute2's ss to list listening sockets")
def test_a_single_node_run_listens_on_loopback_only(tmp_path):
    out = tmp_path / "lo"
    node = subprocess.Popen([sys.executable, "-m", "brigade", "train", "--out", str(out), *TINY,
                             "--max-steps", "100000", "--snapshot-every", "0", "--sample-tokens", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out / "metrics.jsonl").is_file():
            time.sleep(0.2)
        time.sleep(1)  # training: every store and gloo connection is up
        pids = _tree(node.pid)
        listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
        ours = [line for line in listening if any(f"pid={p}," in line for p in pids)]
        assert len(ours) >= 3, listening  # the rendezvous store, rank 0's store, gloo's pairs
        local = [line.split()[3] for line in ours]
        assert all(addr.startswith(("127.", "[::1]")) for addr in local), local
    finally:
        node.terminate()
        node.communicate(timeout=60)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_compiled_run_restarts_from_its_own_compile_cache_and_float8_resumes_in_any_layout(tmp_path):
    """--compile: a worker killed at step 4 restarts; its graphs are cached under OUT/compile-cache
    (inductor's FX graph cache), which the restart's fresh processes read. And a float8 run's
    snapshot (fp32 masters) is resumed by a plain run of another layout."""
    from brigade.train.metrics import read_records, training

    out = tmp_path / "compiled"
    own = {k: v for k, v in os.environ.items() if k != "BRIGADE_COMPILE_CACHE"}  # not the suite's
    done = train(out, "--compile", "--max-steps", "6", "--nproc", "2", "--pp", "2",
                 "--inject-fault", "kill:rank=1:step=4", "--max-restarts", "1", timeout=560, env=own)
    assert done.returncode == 0, done.stderr[-2000:]
    cache = out / "compile-cache"
    assert any(p.is_file() for p in (cache / "fxgraph").rglob("*")), sorted(cache.iterdir())
    steps = [r["step_time_s"] for r in training(read_records(out))]
    print(f"step times of the two attempts, s: {[round(s, 2) for s in steps]}")  # the restart's: cached
    f8 = tmp_path / "float8"
    assert train(f8, "--float8", "tensorwise", "--shard", "2", "--max-steps", "3").returncode == 0
    # no float8, another layout; one step more, the decay's end kept where the 3-step run put it
    resumed = train(f8, "--max-steps", "4", "--decay-steps", "3", "--pp", "2", "--nproc", "2")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from snapshot step 3" in resumed.stdout
