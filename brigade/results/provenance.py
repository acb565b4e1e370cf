"""Which code wrote a results file: the commit of the checkout brigade runs from, and whether its
tree differed from that commit (outside results/, which the runs themselves write).

`regenerate.run_job` stamps every file it writes with `measured_at`, the results table shows it
beside each row, and scripts/durations.py stamps the suite's timings the same way. A file written
before the stamp existed holds `committed_in` instead: the commit that last changed it before the
stamp was added (read from git's history then), so its figures came from that commit's code or
earlier; tests/results/test_provenance.py holds that commit to the history.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]


def commit(root: Path = CHECKOUT) -> str:
    """HEAD's short hash, with `+changes` where the tree differs from it outside results/; "unknown"
    where brigade does not run from a git checkout (an installed wheel)."""
    git = ["git", "-C", str(root)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown"
    dirty = subprocess.run([*git, "status", "--porcelain", "--", ".", ":!results"], capture_output=True,
                           text=True).stdout.strip()
    return head.stdout.strip() + ("+changes" if dirty else "")


def measured_at(data: dict) -> str:
    """The commit a results file records, as the table shows it."""
    if "measured_at" in data:
        return f"`{data['measured_at']}`"
    if "committed_in" in data:
        return f"at or before `{data['committed_in']}` (committed there, not stamped)"
    return "not recorded"
