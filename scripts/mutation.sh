#!/bin/sh
# Mutation testing of the pure plan modules (docs/testing.md, "Mutation testing"): mutmut 3 mutates
# brigade/pipeline/plans/{action,bounds,registry,schedule,simulate,timeline,validate,virtual,
# handwritten,costs,generate}.py and brigade/pipeline/transport/{ordering,nccl}.py (the NCCL ordering
# proof) one change at a time and runs tests/pipeline/plans and the transport's pure tests against
# each mutant; a mutant that no test fails on has survived. MUTATION_MODULES names modules under
# brigade/pipeline (a bare name is one of plans/): MUTATION_MODULES="handwritten" runs only that
# module and keeps the summary's other modules as they were. The run is made in a throwaway copy
# (a clone of the committed tree: uncommitted edits are not in it) with a virtual environment of
# its own in which brigade is not installed, so the tests import mutmut's mutated copy (mutants/)
# and nothing else.
#
#   scripts/mutation.sh        # about 40 minutes on 2 cores
#
# It writes results/mutation/summary.json (or $MUTATION_SUMMARY): per module the mutants, those
# killed (a test failed), those past their time limit (a mutant that loops forever: caught, as
# mutmut counts it) and the survivors, each with its change and the reason it is equivalent, a
# reason kept from the summary already there (a survivor is judged by hand, once). It exits 1 if a
# survivor has no reason: a mutant that no test catches and nobody has judged equivalent.
# MUTATION_WORK: the throwaway folder (default: a new temporary one, removed at the end unless
# MUTATION_KEEP=1); MUTATION_VENV: a virtual environment to reuse (made there if missing).
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
SUMMARY=${MUTATION_SUMMARY:-$ROOT/results/mutation/summary.json}
WORK=${MUTATION_WORK:-$(mktemp -d)}
VENV=${MUTATION_VENV:-$WORK/venv}
MUTMUT_VERSION=3.8.1
MODULES=${MUTATION_MODULES:-"action bounds registry schedule simulate timeline validate virtual handwritten
    costs generate transport/ordering transport/nccl"}

if [ ! -x "$VENV/bin/mutmut" ]; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet "torch==${BRIGADE_TORCH_VERSION:-2.13.0}"
    # brigade's own dependencies and the test tools at the suite's pins, but not brigade itself
    "$VENV/bin/python" -m pip install --quiet -c "$ROOT/constraints.txt" numpy tqdm matplotlib \
        pytest pytest-timeout pytest-xdist hypothesis "mutmut==$MUTMUT_VERSION"
fi

SRC=$WORK/src
rm -rf "$SRC"
git clone --quiet "$ROOT" "$SRC"
cd "$SRC"
{
    echo "[mutmut]"
    echo "source_paths = brigade"  # all of brigade is copied to mutants/; only these are mutated
    echo "only_mutate ="
    for m in $MODULES; do
        case $m in */*) echo "    brigade/pipeline/$m.py" ;; *) echo "    brigade/pipeline/plans/$m.py" ;; esac
    done
    # past twice its tests' time plus 20 s, a mutant is stopped (a timeout): the 20 s cover a forked
    # run's collection, so that a slow start under load is not taken for a mutant that loops
    echo "timeout_multiplier = 2.0"
    echo "timeout_constant = 20.0"
    # serially (the repository's addopts run two xdist workers), the plan tests and the transport's
    # pure ones (not the one that spawns a gloo world to record what P2PTransport issues)
    echo "pytest_add_cli_args ="
    echo "    -o"
    echo "    addopts=-p no:cacheprovider"
    echo "pytest_add_cli_args_test_selection ="
    echo "    tests/pipeline/plans"
    echo "    tests/pipeline/transport/test_ordering.py"
    echo "    tests/pipeline/transport/test_nccl.py"
    echo "    --deselect=tests/pipeline/transport/test_nccl.py::test_p2p_issues_exactly_the_groups_the_proof_runs"
} > setup.cfg

START=$(date +%s)
# One thread per process: each mutant's tests run in a process forked from mutmut's once torch
# has been imported there; two at a time, one per core.
OMP_NUM_THREADS=1 "$VENV/bin/mutmut" run --max-children 2 > "$WORK/mutmut.log" 2>&1 || {
    tail -c 4000 "$WORK/mutmut.log" >&2; exit 1; }
TAKEN=$(( $(date +%s) - START ))

STATUS=0
"$VENV/bin/python" - "$SUMMARY" "$TAKEN" "$VENV/bin/mutmut" "$MUTMUT_VERSION" <<'EOF' || STATUS=$?
import json
import subprocess
import sys
from pathlib import Path

summary, taken, mutmut, version = sys.argv[1:]
KILLED, TIMEOUT = {1, 3, -11, -9}, {36, -24, 24, 152, 255}  # mutmut's exit codes of a mutant's run
old = json.loads(Path(summary).read_text()) if Path(summary).exists() else {"modules": {}}
reasons = {s["mutant"]: s["reason"] for m in old["modules"].values() for s in m["survivors"]}
modules, unjudged = dict(old["modules"]), []  # a run of some modules keeps the others' figures
for meta in sorted(Path("mutants").rglob("*.py.meta")):
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    timeouts = sorted(k for k, code in codes.items() if code in TIMEOUT)
    survivors = []
    for key in sorted(k for k, code in codes.items() if code not in KILLED | TIMEOUT):
        shown = subprocess.run([mutmut, "show", key], capture_output=True, text=True).stdout
        change = [line for line in shown.splitlines()
                  if line[:1] in "+-" and not line.startswith(("+++", "---"))]
        if reasons.get(key) is None:
            unjudged.append(key)
        survivors.append({"mutant": key, "status": codes[key], "change": change,
                          "reason": reasons.get(key)})
    modules[str(meta.relative_to("mutants")).removesuffix(".meta")] = {
        "mutants": len(codes), "killed": len(codes) - len(timeouts) - len(survivors),
        "timeout": len(timeouts), "survived": len(survivors), "timeouts": timeouts,
        "survivors": survivors}
total = {k: sum(m[k] for m in modules.values()) for k in ("mutants", "killed", "timeout", "survived")}
Path(summary).parent.mkdir(parents=True, exist_ok=True)
Path(summary).write_text(json.dumps({"mutmut": version, "seconds": int(taken), **total,
                                     "modules": modules}, indent=1, ensure_ascii=False) + "\n")
for name, m in modules.items():
    print(f"{name}: {m['mutants']} mutants, {m['killed']} killed, {m['timeout']} timeout, "
          f"{m['survived']} survived")
print(f"{total['mutants']} mutants in {taken} s; summary in {summary}")
if unjudged:
    print(f"{len(unjudged)} survivor(s) not judged: add a test that fails on each, or the reason it is "
          "equivalent to the summary:\n  " + "\n  ".join(unjudged))
    sys.exit(1)
EOF

cd "$ROOT"
[ "${MUTATION_KEEP:-0}" = 1 ] || [ -n "${MUTATION_WORK:-}" ] || rm -rf "$WORK"
exit "$STATUS"
