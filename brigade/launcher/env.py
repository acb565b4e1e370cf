"""The launcher's environment, read and checked in one place.

torchrun (and any elastic agent) describes the world in RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT; `srun` in SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID, SLURM_NTASKS_PER_NODE and SLURM_JOB_NODELIST. Whatever of these is set is
checked here, so a bad value is one line naming it instead of a traceback somewhere deeper.
No torch import: `launcher.groups` builds on this; `launcher_world` feeds `config.resolve_layout`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from brigade.config import Launched
from brigade.errors import BrigadeError


@dataclass(frozen=True)
class LauncherEnv:
    """The world a launcher (torchrun's agent, or srun) started this process into."""

    launcher: str  # "torchrun" or "Slurm"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None  # processes on this node, when the launcher says


# (variable, lowest, highest): highest is a number, or "<NAME" / "<=NAME", a variable read before it
_CHECKS = (("MASTER_PORT", 1, 65535), ("WORLD_SIZE", 1, None), ("RANK", 0, "<WORLD_SIZE"),
           ("LOCAL_WORLD_SIZE", 1, "<=WORLD_SIZE"), ("LOCAL_RANK", 0, "<LOCAL_WORLD_SIZE"),
           ("GROUP_RANK", 0, None), ("SLURM_JOB_ID", 0, None), ("SLURM_NNODES", 1, None),
           ("SLURM_NODEID", 0, "<SLURM_NNODES"), ("SLURM_NTASKS", 1, None),
           ("SLURM_PROCID", 0, "<SLURM_NTASKS"), ("SLURM_NTASKS_PER_NODE", 1, "<=SLURM_NTASKS"),
           ("SLURM_LOCALID", 0, "<SLURM_NTASKS_PER_NODE"))


def _read_env(env: Mapping[str, str]) -> dict[str, int]:
    """Every launcher variable that is set, as an integer checked against its range.

    Raises:
        BrigadeError: not an integer, or out of range; one line naming the variable and value.
    """
    values: dict[str, int] = {}
    for name, lo, hi in _CHECKS:
        text = env.get(name)
        if text is None:
            continue
        per_node = name == "SLURM_NTASKS_PER_NODE"
        try:
            value = _tasks_per_node(text, values.get("SLURM_NODEID", 0)) if per_node else int(text)
        except (ValueError, IndexError):
            _refuse(name, text, "a count per node like 4 or 2(x3),1" if per_node else "an integer")
        other = hi.lstrip("<=") if isinstance(hi, str) else None
        top = (values[other] - (hi[1] != "=")) if other in values else (None if other else hi)
        if value < lo or (top is not None and value > top):
            _refuse(name, text, f"between {lo} and {top}" if top is not None else f"at least {lo}",
                    f" ({other}={env[other]})" if other in values else "")
        values[name] = value
    return values


def _refuse(name: str, text: str, expected: str, why: str = "") -> None:
    raise BrigadeError(f"environment variable {name}={text!r}: expected {expected}{why}; a launcher "
                       "(torchrun, srun) sets it: fix or unset it")


def _tasks_per_node(text: str, node: int) -> int:
    """This node's count in SLURM_NTASKS_PER_NODE: '4', '2(x3)', '2(x3),1'."""
    counts: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(text)
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node]


def launcher_env(env: Mapping[str, str] | None = None) -> LauncherEnv | None:
    """The world a launcher set for this process; None when brigade is to start the processes.

    torchrun (and any elastic agent) sets RANK and WORLD_SIZE; `srun -n N` with N > 1 sets
    SLURM_PROCID and SLURM_NTASKS. Every such variable that is set is checked, launcher or not.

    Raises:
        BrigadeError: a variable that is not an integer or out of range, one line naming it.
    """
    v = _read_env(os.environ if env is None else env)
    if "RANK" in v and "WORLD_SIZE" in v:
        return LauncherEnv("torchrun", v["RANK"], v["WORLD_SIZE"], v.get("LOCAL_RANK", 0),
                           v.get("LOCAL_WORLD_SIZE"))
    if "SLURM_PROCID" in v and v.get("SLURM_NTASKS", 1) > 1:
        return LauncherEnv("Slurm", v["SLURM_PROCID"], v["SLURM_NTASKS"], v.get("SLURM_LOCALID", 0),
                           v.get("SLURM_NTASKS_PER_NODE"))
    return None


def slurm_env(env: Mapping[str, str]) -> dict[str, str]:
    """torchrun-style variables from Slurm's, for `srun python -m brigade train ...`.

    One task per process: RANK = SLURM_PROCID, WORLD_SIZE = SLURM_NTASKS,
    LOCAL_RANK = SLURM_LOCALID; the store lives on the first node of the job.

    Raises:
        BrigadeError: a SLURM_* variable that is not an integer or out of range.
    """
    v = _read_env(env)
    if "SLURM_PROCID" not in v:
        raise BrigadeError("SLURM_PROCID is not set: run brigade with srun, or without Slurm's variables")
    nodes = expand_nodelist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "localhost"))
    return {
        "RANK": str(v["SLURM_PROCID"]),
        "WORLD_SIZE": str(v.get("SLURM_NTASKS", 1)),
        "LOCAL_RANK": str(v.get("SLURM_LOCALID", 0)),
        "LOCAL_WORLD_SIZE": str(v.get("SLURM_NTASKS_PER_NODE", 1)),
        "MASTER_ADDR": env.get("MASTER_ADDR", nodes[0]),
        "MASTER_PORT": env.get("MASTER_PORT", str(29500 + v.get("SLURM_JOB_ID", 0) % 1000)),
    }


def expand_nodelist(text: str) -> list[str]:
    """'gpu[01-03,07],login1' → ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login1']."""
    hosts = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,]+)", text):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{n:0{len(lo)}d}")
    return hosts


def launcher_world(env: Mapping[str, str] | None = None) -> Launched | None:
    """The launcher's world as `config.resolve_layout` takes it; None when brigade starts the processes.

    Raises:
        BrigadeError: a launcher variable that is not an integer or out of range.
    """
    found = launcher_env(env)
    return None if found is None else Launched(found.world_size, found.local_world_size, found.launcher)


def under_launcher(env: Mapping[str, str] | None = None) -> bool:
    """True inside a worker started by torchrun / an elastic agent, or one of several srun tasks.

    Raises:
        BrigadeError: a launcher variable (RANK, WORLD_SIZE, SLURM_*, ...) that is not an integer
            or out of range.
    """
    env = os.environ if env is None else env
    return launcher_world(env) is not None or "TORCHELASTIC_RUN_ID" in env
