"""A watchdog for the suite that still fires when a test blocks in C with the GIL held.

pytest-timeout's signal method runs its handler on the main thread, between two Python
bytecodes: a test stuck in C code that holds the GIL (the suite once hung 20 minutes in a gloo
process group's destructor, joining a thread that waited for that GIL) never gets there, and no
Python thread can run either. faulthandler's watchdog is a C thread that needs no GIL: past the
test's own timeout plus `MARGIN_S`, it writes every Python thread's stack to the terminal and
ends the process (under xdist, pytest then reports the worker crashed in that test, and the run
goes on with a new worker).

Loaded by tests/conftest.py; `BRIGADE_WATCHDOG_MARGIN_S` overrides the margin (its own test).
"""

from __future__ import annotations

import faulthandler
import os

import pytest

MARGIN_S = float(os.environ.get("BRIGADE_WATCHDOG_MARGIN_S", "60"))
_TERMINAL: list[int] = []  # the real stderr, duplicated before pytest captured it


def pytest_configure(config: pytest.Config) -> None:
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is None:
        _TERMINAL.append(os.dup(2))
        return
    with capture.global_and_fixture_disabled():  # fd 2 is a capture file while tests run
        _TERMINAL.append(os.dup(2))


def limit_of(item: pytest.Item) -> float | None:
    """The test's pytest-timeout limit in seconds (its marker, else the ini's); None: no limit."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and (marker.args or "timeout" in marker.kwargs):
        value = marker.args[0] if marker.args else marker.kwargs["timeout"]
    else:
        value = item.config.getini("timeout")  # pytest-timeout's ini key (pyproject: 300)
    try:
        limit = float(value)
    except (TypeError, ValueError):
        return None
    return limit if limit > 0 else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    limit = limit_of(item)
    if limit is not None and _TERMINAL:
        faulthandler.dump_traceback_later(limit + MARGIN_S, exit=True, file=_TERMINAL[0])
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
