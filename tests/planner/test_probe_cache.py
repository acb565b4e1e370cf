"""This machine's probe kept between commands (`planner.probe_cache`): reused for a day on the same
machine and code, measured again otherwise, or when asked (`--reprobe`), or when the file is
damaged; a folder that cannot be written costs only the time."""

from dataclasses import replace

import pytest

from brigade.planner import devices, probe_cache

FAKE = replace(devices.TABLE["h100"], name="cpu", measured=True, cores=2)


@pytest.fixture
def probes(tmp_path, monkeypatch):
    """Each real probe replaced by FAKE with a count of them; a fresh cache folder, and this
    process's own probe forgotten."""
    made = []

    def probe():
        made.append(1)
        return replace(FAKE, peak_fp32=FAKE.peak_fp32 + len(made))  # each measurement tells itself apart

    monkeypatch.setenv("BRIGADE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(devices, "probe", probe)
    monkeypatch.setattr(devices, "_PROBED", [])
    return made


def _next_command(monkeypatch):
    """As a new `brigade plan` process starts: nothing probed in it yet."""
    monkeypatch.setattr(devices, "_PROBED", [])


def test_a_probe_is_kept_and_the_next_command_reuses_it(probes, monkeypatch, tmp_path):
    first = devices.device("cpu")
    assert probes == [1] and (tmp_path / "cache" / probe_cache.FILE).is_file()
    assert devices.device("cpu") is first  # once per process
    _next_command(monkeypatch)
    assert devices.device("cpu") == first and probes == [1]  # read back, not measured


def test_reprobe_measures_again_and_keeps_the_new_one(probes, monkeypatch):
    first = devices.cpu()
    again = devices.device("cpu", reprobe=True)
    assert probes == [1, 1] and again != first
    _next_command(monkeypatch)
    assert devices.cpu() == again and len(probes) == 2


@pytest.mark.parametrize("spoil", ["old", "other code", "damaged", "other fields"])
def test_a_probe_that_no_longer_stands_for_the_machine_is_measured_again(probes, monkeypatch, tmp_path, spoil):
    devices.cpu()
    path = tmp_path / "cache" / probe_cache.FILE
    if spoil == "old":
        monkeypatch.setattr(probe_cache, "MAX_AGE_S", -1)
    elif spoil == "other code":
        monkeypatch.setattr(devices, "_SOURCES", [devices.__file__])  # the gloo probe's code left out
    elif spoil == "damaged":
        path.write_text(path.read_text()[:40])
    else:
        path.write_text(path.read_text().replace('"peak_fp32"', '"peak_fp64"'))
    _next_command(monkeypatch)
    devices.cpu()
    assert len(probes) == 2


def test_a_folder_that_cannot_be_written_costs_only_the_time(probes, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("BRIGADE_CACHE_DIR", str(blocker / "cache"))
    assert devices.cpu().name == "cpu"
    _next_command(monkeypatch)
    assert devices.cpu().name == "cpu" and len(probes) == 2


def test_the_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("BRIGADE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert probe_cache.folder() == tmp_path / "brigade"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert probe_cache.folder() == tmp_path / "home" / ".cache" / "brigade"


def test_plan_reprobe_reaches_the_probe(probes, cli):
    """`brigade plan --reprobe` on cpu measures this machine again though a probe is kept."""
    devices.cpu()
    done = cli("plan", "--model", "gpt", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--seq-len", "16",
               "--batch-size", "4", "--costs", "formula", "--reprobe", "--top", "1")
    assert done.returncode == 0, done.stderr
    assert len(probes) == 2
