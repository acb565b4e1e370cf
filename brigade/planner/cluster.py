"""The target cluster: nodes × devices per node, and the device (`devices.py`), from flags or a
TOML file:

    nodes = 4
    devices_per_node = 8
    [device]                 # a built-in name, or every field of DeviceSpec
    name = "h100"            # alone: the table's; with other fields: those override it
    profile = "gpu.json"     # optional: a measured GPU profile (`planner.profile`), relative
                             # to the file: its matmul, copy and allocator figures

Each field missing or unknown is one line naming it and what is expected.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path

import tomllib

from brigade.errors import BrigadeError
from brigade.planner import profile
from brigade.planner.devices import FIELDS, NAMES, OPTIONAL, TABLE, DeviceSpec, device

TOP = ("nodes", "devices_per_node", "device")


@dataclass(frozen=True)
class Cluster:
    """`nodes` machines of `per_node` devices each. Ranks are numbered node by node."""

    nodes: int
    per_node: int
    device: DeviceSpec

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def describe(self) -> str:
        return f"{self.nodes} node{'s' * (self.nodes > 1)} × {self.per_node} {self.device.name}"


def from_flags(nodes: int, per_node: int, name: str, reprobe: bool = False) -> Cluster:
    """A cluster of a built-in device ("cpu" probed again with `reprobe`).

    Raises:
        BrigadeError: a size below 1 or an unknown device.
    """
    for flag, v in (("--nodes", nodes), ("--gpus-per-node", per_node)):
        if v < 1:
            raise BrigadeError(f"{flag} {v}: must be ≥ 1")
    return Cluster(nodes, per_node, device(name, reprobe))


def load(path: str | Path) -> Cluster:
    """The cluster a TOML file describes (module docstring).

    Raises:
        BrigadeError: unreadable, not TOML, a missing or unknown field, a value of the wrong kind.
    """
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise BrigadeError(f"--cluster {path}: cannot read it ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise BrigadeError(f"--cluster {path}: not TOML: {exc}") from None
    _known(data, TOP, path, "")
    for key in TOP:
        if key not in data:
            what = (
                "a table: a built-in name, or every DeviceSpec field" if key == "device" else "an integer ≥ 1"
            )
            raise BrigadeError(f"--cluster {path}: no {key}: expected {key} = {what}")
    nodes, per = (_int(data, k, path) for k in ("nodes", "devices_per_node"))
    return Cluster(nodes, per, _device(data["device"], path))


def _known(table: dict, allowed, path, where: str) -> None:
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise BrigadeError(
            f"--cluster {path}: unknown field {where}{unknown[0]}: expected one of {', '.join(allowed)}"
        )


def _int(data: dict, key: str, path) -> int:
    v = data[key]
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise BrigadeError(f"--cluster {path}: {key} = {v!r}: expected an integer ≥ 1")
    return v


def _device(table, path) -> DeviceSpec:
    """A [device] table: a built-in name alone, or with overrides, or every field."""
    if not isinstance(table, dict):
        raise BrigadeError(f"--cluster {path}: device must be a [device] table, not {table!r}")
    _known(table, ("name", "profile", *FIELDS), path, "device.")
    name = table.get("name")
    if not isinstance(name, str) or not name:
        raise BrigadeError(
            f"--cluster {path}: no device.name: expected a name (a built-in one: "
            f"{', '.join(NAMES)}, or your own with every field)"
        )
    base = device(name) if name.lower() in NAMES else None
    hints = typing.get_type_hints(DeviceSpec)
    values = {}
    for key in FIELDS:
        if key in table:
            v = table[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise BrigadeError(f"--cluster {path}: device.{key} = {v!r}: expected a number ≥ 0")
            values[key] = hints[key](v)
        elif base is None and key not in OPTIONAL:
            raise BrigadeError(
                f"--cluster {path}: no device.{key} for device {name!r}, which is not "
                f"built in ({', '.join(TABLE)}, cpu): give {key} ({_UNITS[key]})"
            )
    spec = dataclasses.replace(base, **values) if base is not None else DeviceSpec(name=name, **values)
    if "profile" in table:
        where = Path(path).parent / str(table["profile"])
        spec = profile.applied(spec, profile.read(where), set(values))
    return spec


_UNITS = {
    "peak_bf16": "FLOP/s, 0 if not known",
    "peak_fp32": "FLOP/s, 0 if not known",
    "memory": "bytes",
    "intra_bw": "bytes/s one way",
    "intra_latency": "seconds",
    "inter_bw": "bytes/s one way",
    "inter_latency": "seconds",
    "mem_bw": "bytes/s",
    "cores": "devices sharing a host's compute",
    "shared_slowdown": "a number ≥ 1",
    "all_reduce_bw": "bytes/s a ring all-reduce inside a node achieves, 0: intra_bw",
    "all_gather_bw": "bytes/s a ring all-gather inside a node achieves, 0: intra_bw",
    "reduce_scatter_bw": "bytes/s a ring reduce-scatter inside a node achieves, 0: intra_bw",
    "coll_latency": "seconds per ring step of a collective inside a node, 0: intra_latency",
    "dtensor_step_s": "seconds AdamW's step adds per DTensor parameter, 0: not counted",
    "action_s": "seconds the pipeline runtime adds to each action, 0: not counted",
    "runtime_step_s": "seconds the pipeline runtime adds to each step, 0: not counted",
    "crowded_action_s": "seconds per action where a host has more processes than cores, 0: action_s",
    "tp_collective_s": "seconds a tensor-parallel block's collective adds as issued, 0: not counted",
    "crowded_tp_collective_s": "the same where a host has more processes than cores, 0: tp_collective_s",
    "peak_fp8": "FLOP/s of float8 matmuls, 0 if not known",
    "matmul_eff": "the share of the matmul peak a matmul reaches, 1: the peak",
    "attention_eff": "the share of the bf16 peak a fused attention's forward reaches, 1: the peak",
    "attention_bwd_eff": "the same for its backward, 1: the peak",
    "mem_eff": "the share of mem_bw a memory-bound kernel reaches, 1: mem_bw",
    "reserve_frac": "the share of allocated memory the caching allocator holds beyond it, 0: not measured",
}
