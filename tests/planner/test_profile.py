"""A GPU profile (`planner.profile`, written by scripts/gpu-check.sh) read from a --cluster file on
the CPU: its figures become the device's shares of its peaks; each mistake one line."""

import json

import pytest

from brigade.errors import BrigadeError
from brigade.planner import cluster
from brigade.planner.devices import TABLE

PROFILE = {"matmul_flops": 700e12, "mem_bw": 2.8e12, "reserve_frac": 0.06, "device": "NVIDIA H100 80GB HBM3",
           "torch": "2.9.0"}


def files(tmp_path, profile, table="") -> str:
    (tmp_path / "gpu.json").write_text(profile if isinstance(profile, str) else json.dumps(profile))
    path = tmp_path / "c.toml"
    path.write_text(f"nodes = 1\ndevices_per_node = 8\n[device]\nname = 'h100'\nprofile = 'gpu.json'\n{table}")
    return str(path)


def test_a_profile_sets_the_shares_of_the_peaks_it_measured(tmp_path):
    d = cluster.load(files(tmp_path, PROFILE)).device
    h100 = TABLE["h100"]
    assert d.matmul_eff == pytest.approx(700e12 / h100.peak_bf16)
    assert d.mem_eff == pytest.approx(2.8e12 / h100.mem_bw)
    assert d.reserve_frac == 0.06
    assert d.attention_eff == h100.attention_eff  # not measured: the published share stays


def test_a_field_the_table_gives_wins_over_the_profile(tmp_path):
    d = cluster.load(files(tmp_path, PROFILE, "matmul_eff = 0.5\n")).device
    assert d.matmul_eff == 0.5 and d.reserve_frac == 0.06


@pytest.mark.parametrize("profile, words", [
    ("{", "not JSON"),
    ({**PROFILE, "mem_bw": "fast"}, "mem_bw = 'fast': expected a number > 0"),
    ({k: v for k, v in PROFILE.items() if k != "reserve_frac"}, "reserve_frac = None: expected a number ≥ 0"),
])
def test_each_mistake_in_a_profile_is_one_line(tmp_path, profile, words):
    with pytest.raises(BrigadeError, match=words) as err:
        cluster.load(files(tmp_path, profile))
    assert "\n" not in str(err.value)


def test_a_missing_profile_is_named(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("nodes = 1\ndevices_per_node = 8\n[device]\nname = 'h100'\nprofile = 'none.json'\n")
    with pytest.raises(BrigadeError, match=r"device.profile .*none.json: cannot read it"):
        cluster.load(str(path))
