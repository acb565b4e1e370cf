"""`brigade train` end to end: what a user runs and what they get."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import TINY, brigade, final_hash, losses, train

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    result = train(out, "--max-steps", "20", "--snapshot-every", "10")
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
    assert {"step", "loss", "lr", "tokens_per_s", "step_time_s"} <= set(steps[0])
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(vals) == 3 and vals[-1] < vals[0]
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


def test_generate_plot_inspect(run_dir):
    out, _ = run_dir
    gen = brigade("generate", "--from", out, "--prompt", "def ", "--tokens", "30")
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("def ") and len(gen.stdout.rstrip("\n")) == 34
    (out / "loss.png").unlink()
    plot = brigade("plot", out)
    assert plot.returncode == 0 and (out / "loss.png").is_file()
    info = json.loads(brigade("inspect", out, "--json").stdout)
    assert info["step"] == 20 and info["layout"] == {"dp": 2, "pp": 1, "local_stages": 1}
    assert len(info["params_sha256"]) == 64 and info["checksums"] == "ok"


def test_plot_of_an_unfinished_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0, "lr": 0.1}\n{"step": 2, "lo')
    assert brigade("plot", tmp_path).returncode == 0 and (tmp_path / "loss.png").is_file()


def test_runs_under_torchrun(tmp_path):
    from brigade.dist import free_port

    out = tmp_path / "tr"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "-m", "brigade", "train", "--out", str(out), *TINY, "--pp", "2",
           "--max-steps", "4", "--sample-tokens", "0"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert max(losses(out)) > 0 and len(losses(out)) == 4
    assert json.loads(brigade("inspect", out, "--json").stdout)["layout"]["pp"] == 2


def test_runs_under_slurm_variables(tmp_path):
    """Two tasks as `srun -n 2` would start them: SLURM_* only, no torchrun variables."""
    from brigade.dist import free_port

    port = str(free_port())
    out = tmp_path / "slurm"
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                   SLURM_JOB_NODELIST="localhost", MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "brigade", "train", "--out", str(out), *TINY, "--max-steps", "3",
             "--nproc", "2", "--sample-tokens", "0"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-2000:]
    assert len(losses(out)) == 3


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
    """Two `brigade train` agents, --nnodes 2, meeting at one rendezvous endpoint on loopback."""
    import socket

    from brigade.dist import free_port

    port = free_port()
    out = tmp_path / "nodes"
    common = ["train", "--out", str(out), *TINY, "--nnodes", "2", "--nproc", "1", "--pp", "2",
              "--max-steps", "4", "--sample-tokens", "0", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen([sys.executable, "-m", "brigade", *common, "--node-rank", "0"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    for _ in range(200):  # node 0 hosts the store: wait until it listens
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    nodes.append(subprocess.Popen([sys.executable, "-m", "brigade", *common, "--node-rank", "1"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for node in nodes:
        _, err = node.communicate(timeout=240)
        assert node.returncode == 0, err[-2000:]
    assert len(losses(out)) == 4
    assert json.loads(brigade("inspect", out, "--json").stdout)["layout"]["pp"] == 2


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
