"""The launcher's environment (torchrun's and Slurm's variables) and the devices a layout needs.

Garbage in any launcher variable is one line naming it, a non-zero exit, and nothing written.
The catalogue runs `brigade train` in this process (the `cli` fixture, tests/conftest.py) with the
variables set by monkeypatch; one case runs the real command in a subprocess, end to end.
"""

import os
import subprocess
import sys

import pytest
import torch

from brigade import config
from brigade.errors import BrigadeError
from brigade.launcher.env import LauncherEnv, launcher_env, launcher_world, slurm_env

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith("SLURM_")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


FLAGS = ["--max-steps", "1", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--context", "16",
         "--block-size", "16", "--batch-size", "8"]


def train(tmp_path, env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    """The real command, in a subprocess with exactly `env`."""
    out = tmp_path / "out"
    return subprocess.run([sys.executable, "-m", "brigade", "train", "--out", str(out), *FLAGS, *flags],
                          capture_output=True, text=True, timeout=120, env=env)


def train_here(cli, monkeypatch, tmp_path, variables: dict[str, str], *flags: str):
    """The same command in this process, under the launcher variables `variables` and no others."""
    for name in [*LAUNCHER_VARS, *(k for k in os.environ if k.startswith("SLURM_"))]:
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    return cli("train", "--out", tmp_path / "out", *FLAGS, *flags)


def assert_refused(result: subprocess.CompletedProcess, tmp_path, *words: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0, result.stdout
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for word in words:
        assert word in lines[0], lines[0]
    assert not (tmp_path / "out").exists()  # nothing written, not even the folder


GARBAGE = [
    # (variables, the variable and value the line must name)
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc'"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK='2'"),  # a rank past the world
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1'"),
    ({"LOCAL_RANK": "zero"}, "LOCAL_RANK='zero'"),
    ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK='2'"),
    ({"LOCAL_WORLD_SIZE": "3", "WORLD_SIZE": "2", "RANK": "0"}, "LOCAL_WORLD_SIZE='3'"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT='http'"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT='70000'"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT='0'"),
    ({"SLURM_PROCID": "first", "SLURM_NTASKS": "2"}, "SLURM_PROCID='first'"),
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, "SLURM_PROCID='4'"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "-2"}, "SLURM_NTASKS='-2'"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "-1"}, "SLURM_LOCALID='-1'"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_LOCALID": "2"},
     "SLURM_LOCALID='2'"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "two"},
     "SLURM_NTASKS_PER_NODE='two'"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "4"}, "SLURM_NTASKS_PER_NODE='4'"),
    ({"SLURM_JOB_ID": "12a"}, "SLURM_JOB_ID='12a'"),
    ({"SLURM_NNODES": "2", "SLURM_NODEID": "2"}, "SLURM_NODEID='2'"),
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("variables,named", GARBAGE, ids=[named for _, named in GARBAGE])
def test_launcher_garbage_is_one_line(cli, monkeypatch, tmp_path, variables, named):
    result = train_here(cli, monkeypatch, tmp_path, variables)
    assert_refused(result, tmp_path, "brigade train: error: environment variable", named)


@pytest.mark.timeout(150)
def test_launcher_garbage_is_one_line_from_the_real_command(tmp_path):
    variables, named = GARBAGE[2]  # RANK='x'
    result = train(tmp_path, clean_env(**variables))
    assert_refused(result, tmp_path, "brigade train: error: environment variable", named)
    assert result.returncode == 2


@pytest.mark.parametrize("variables,named", GARBAGE, ids=[named for _, named in GARBAGE])
def test_launcher_env_names_the_variable(variables, named):
    with pytest.raises(BrigadeError, match="^environment variable " + named.replace("(", r"\(")) as err:
        launcher_env(variables)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("variables,expected", [
    ({}, None),
    ({"WORLD_SIZE": "4"}, None),  # no RANK: not started by a launcher
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, None),  # one task: brigade starts the processes
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
     LauncherEnv("torchrun", 3, 4, 1, 2)),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "2(x2),1",
      "SLURM_NNODES": "3", "SLURM_NODEID": "2"}, LauncherEnv("Slurm", 5, 6, 0, 1)),
    # torchrun inside a Slurm allocation: torchrun's variables win
    ({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
     LauncherEnv("torchrun", 1, 2, 0, None)),
])
def test_launcher_env_reads_the_world(variables, expected):
    assert launcher_env(variables) == expected


def test_launcher_world_and_slurm_translation():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2(x2)",
           "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "1234"}
    assert launcher_world(env) == config.Launched(4, 2, "Slurm")
    assert slurm_env(env) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                              "MASTER_ADDR": "gpu07", "MASTER_PORT": "29734"}


def test_a_typed_flag_that_contradicts_the_launcher_is_one_line(cli, monkeypatch, tmp_path):
    """Under torchrun's variables the launcher's world decides; a contradicting --nproc is refused."""
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}
    result = train_here(cli, monkeypatch, tmp_path, env, "--nproc", "2", "--pp", "2")
    assert_refused(result, tmp_path, "--nproc 2 but torchrun started 4 processes on this node")
    assert result.returncode == 2
    result = train_here(cli, monkeypatch, tmp_path, env, "--dp", "1", "--pp", "2")
    assert_refused(result, tmp_path, "--dp 1 × --pp 2 = 2 but the world size is 4 (set by torchrun)")


# --- devices: a GPU layout on a machine without (enough) GPUs, refused before any process -------

@pytest.mark.timeout(150)
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has GPUs: nccl is not refused")
@pytest.mark.parametrize("flags", [["--backend", "nccl"], ["--local-stages", "2", "--backend", "nccl"]])
def test_nccl_without_gpus_is_refused_before_any_process(cli, monkeypatch, tmp_path, flags):
    result = train_here(cli, monkeypatch, tmp_path, {}, *flags)
    assert_refused(result, tmp_path, "backend nccl needs CUDA GPUs and none is visible: use --backend gloo")
    assert result.returncode == 2 and "brigade: training" not in result.stdout


def test_a_layout_needing_more_gpus_than_visible_is_refused(tmp_path, monkeypatch):
    from brigade.train.run import preflight

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = config.RunConfig()
    cfg.parallel.nproc, cfg.parallel.local_stages, cfg.parallel.backend = 2, 2, "nccl"
    cfg.train.out = str(tmp_path / "out")
    with pytest.raises(BrigadeError, match=r"^--nproc 2 × --local-stages 2 on nccl needs 4 GPUs on this node "
                                           r"but 2 are visible"):
        preflight(cfg)
    assert not (tmp_path / "out").exists()
