"""This machine's probe, kept between commands.

`brigade plan` on the "cpu" device measures this machine first (`devices.cpu`: about 20 s, most of
it the shared-cores turns and gloo over loopback), and a second plan on the same machine an hour
later would measure the same machine again. The probe is kept instead: one JSON file per machine
in the cache folder (`$BRIGADE_CACHE_DIR`, else `$XDG_CACHE_HOME/brigade`, else
`~/.cache/brigade`), reused for a day (`MAX_AGE_S`) while the machine's name, its cores, torch's
version and the probe's own code (the two modules that measure) are what they were.
`brigade plan --reprobe` measures again and keeps the new probe.

A cache that cannot be read or written costs nothing but the time: the probe runs as it would
without one, and a damaged file is measured over.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import time
from pathlib import Path

MAX_AGE_S = 24 * 3600  # a day: what the machine was doing when probed stops standing for it after
FILE = "cpu-probe.json"


def folder() -> Path:
    """The cache folder (module docstring)."""
    if os.environ.get("BRIGADE_CACHE_DIR"):
        return Path(os.environ["BRIGADE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "brigade"


def key(sources: list[str]) -> str:
    """What a kept probe must have been measured under: this machine, its cores, torch, and the
    `sources` of the modules that measure (a change to the probe measures again)."""
    import torch

    code = hashlib.sha256()
    for source in sources:
        code.update(Path(source).read_bytes())
    return f"{platform.node()}|{os.cpu_count()}|{torch.__version__}|{code.hexdigest()[:16]}"


def load(cls, sources: list[str]):
    """The kept probe as a `cls` (DeviceSpec), or None: none kept, another key, older than a day,
    or unreadable."""
    try:
        data = json.loads((folder() / FILE).read_text(encoding="utf-8"))
        if data["key"] != key(sources) or not 0 <= time.time() - data["time"] <= MAX_AGE_S:
            return None
        return cls(**data["spec"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save(spec, sources: list[str]) -> None:
    """Keep `spec` (a DeviceSpec, measured by `sources`) for the next command; written whole or
    not at all."""
    path = folder() / FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key(sources), "time": time.time(), "spec": dataclasses.asdict(spec)},
                                  indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass
