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
import time

import pytest

MARGIN_S = float(os.environ.get("BRIGADE_WATCHDOG_MARGIN_S", "60"))
_TERMINAL: list[int] = []  # the real stderr, duplicated before pytest captured it
_DEADLINE: list[float] = []  # when the armed watchdog fires (monotonic), while one is armed


def _arm(seconds: float) -> None:
    faulthandler.dump_traceback_later(seconds, exit=True, file=_TERMINAL[0])
    _DEADLINE[:] = [time.monotonic() + seconds]


def _disarm() -> None:
    faulthandler.cancel_dump_traceback_later()
    _DEADLINE.clear()


# A process forked while the watchdog is armed inherits its lock held by a thread it does not
# have: the child's first dump_traceback_later (brigade's workers arm one around their teardown)
# would wait on it for ever. So the watchdog stops just before a fork, and the parent re-arms
# it for the time that was left; the child starts with none.
def _before_fork() -> None:
    if _DEADLINE:
        faulthandler.cancel_dump_traceback_later()


def _after_fork_in_parent() -> None:
    if _DEADLINE:
        _arm(max(1.0, _DEADLINE[0] - time.monotonic()))


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_DEADLINE.clear)


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
        _arm(limit + MARGIN_S)
    try:
        yield
    finally:
        _disarm()
