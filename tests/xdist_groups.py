"""`--dist loadgroup` that groups under pytest 9 too: a plugin of the suite's (tests/conftest.py).

pytest-xdist sends the tests marked `xdist_group(NAME)` to one worker by suffixing their node id
with `@NAME` as the workers collect them. It does so by assigning `item._nodeid`, which pytest 9
no longer reads (a node's id lives in `item._id`): under pytest 9.2 with xdist 3.8 every group
was silently spread over both workers, and every spawned world a group shares was started once
per worker instead of once. This hook, run after xdist's, gives an item of a group the suffix
xdist meant to give it, where it is missing; under a pytest where xdist's own suffix holds it
does nothing. `tests/test_xdist_groups.py` checks that a group lands on one worker.
"""

from __future__ import annotations

import pytest


def _group(item: pytest.Item) -> str | None:
    names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
             for m in item.iter_markers("xdist_group")}
    return "_".join(sorted(names)) if names else None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not getattr(config.option, "loadgroup", False):  # set on xdist's workers under loadgroup
        return
    for item in items:
        group = _group(item)
        if group is None or item.nodeid.endswith(f"@{group}"):
            continue
        from _pytest.nodeid import coerce_node_id  # pytest 9: where a node's id is kept

        item._id = coerce_node_id(f"{item.nodeid}@{group}")
