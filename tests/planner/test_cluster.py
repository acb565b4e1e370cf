"""Cluster files and devices: each mistake one line naming the field."""

import pytest

from brigade.errors import BrigadeError
from brigade.planner import cluster
from brigade.planner.devices import TABLE, device

FULL = (
    "[device]\nname = 'mygpu'\npeak_bf16 = 1e15\npeak_fp32 = 6e13\nmemory = 8e10\nintra_bw = 4e11\n"
    "intra_latency = 3e-6\ninter_bw = 5e10\ninter_latency = 8e-6\nmem_bw = 3e12\n"
)


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_a_full_device_and_a_built_in_one_with_an_override(tmp_path):
    c = cluster.load(write(tmp_path, "nodes = 2\ndevices_per_node = 8\n" + FULL))
    assert (c.nodes, c.per_node, c.world, c.device.name, c.device.peak("bf16")) == (2, 8, 16, "mygpu", 1e15)
    c = cluster.load(
        write(tmp_path, "nodes = 1\ndevices_per_node = 4\n[device]\nname = 'h100'\nmemory = 4e10\n")
    )
    assert c.device.memory == 4e10 and c.device.peak("") == TABLE["h100"].peak_fp32


@pytest.mark.parametrize(
    "text, words",
    [
        ("devices_per_node = 8\n" + FULL, "no nodes: expected nodes = an integer ≥ 1"),
        ("nodes = 1\ndevices_per_node = 8\n" + FULL.replace("mem_bw = 3e12\n", ""), "no device.mem_bw"),
        ("nodes = 1\ndevices_per_node = 8\n" + FULL + "colour = 3\n", "unknown field device.colour"),
        ("nodes = 0\ndevices_per_node = 8\n" + FULL, "nodes = 0: expected an integer ≥ 1"),
        ("nodes = 1\ndevices_per_node = 8\nspeed = 1\n" + FULL, "unknown field speed"),
        (
            "nodes = 1\ndevices_per_node = 8\n[device]\nname = 'h100'\nmemory = 'big'\n",
            "device.memory = 'big'",
        ),
        ("nodes = [\n", "not TOML"),
    ],
)
def test_each_mistake_is_one_line(tmp_path, text, words):
    with pytest.raises(BrigadeError) as err:
        cluster.load(write(tmp_path, text))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_unknown_device_and_no_known_peak():
    with pytest.raises(BrigadeError, match="unknown device: expected h100, h200, a100, cpu"):
        device("tpu")
    assert device("A100 80GB") is TABLE["a100"]
    no_bf16 = cluster.Cluster(1, 1, TABLE["h100"].__class__(**{**vars(TABLE["h100"]), "peak_bf16": 0.0}))
    with pytest.raises(BrigadeError, match="no known bf16 peak: give peak_bf16"):
        no_bf16.device.peak("bf16")
