#!/usr/bin/env bash
# Move constraints.txt forward: install brigade's test tools at their newest releases into a
# brand-new virtual environment, run the whole suite there, and only if it passes write the
# versions it ran with into constraints.txt (review and commit the diff).
#   scripts/update-pins.sh            # newest of everything, then the suite
#   scripts/update-pins.sh -k bench   # extra arguments go to pytest (a quicker look; pins are
#                                     # written only when the whole suite ran)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "torch==${BRIGADE_TORCH_VERSION:-2.13.0}"
"$venv/bin/python" -m pip install --quiet -e ".[dev,hf,float8,data]"   # no constraints: the newest releases
if [ "$#" -gt 0 ]; then
    "$venv/bin/python" -m pytest "$@"
    echo "update-pins: ran a subset (pytest $*): constraints.txt left as it is"
    exit 0
fi
"$venv/bin/python" -m pytest                # the default tier, as the README runs it
"$venv/bin/python" -m pytest -m "full or slow"   # the full and slow tiers, as CI runs them next
{
    sed -n '1,3p' constraints.txt
    "$venv/bin/python" -m pip freeze --exclude-editable | grep -v '^torch=='
} > constraints.txt.new
mv constraints.txt.new constraints.txt
git --no-pager diff --stat -- constraints.txt
echo "update-pins: the suite passed with the newest releases; constraints.txt now holds them"
