#!/usr/bin/env bash
# brigade against torchtitan on one GPU: the same Llama 3 model (torchtitan's "1B", 1.24 B
# parameters), sequence 2048, bf16 and compiled, then float8 (rowwise), trained for the same steps
# by each through its own command line; tokens/s/GPU, MFU and peak memory side by side with their
# ratios, in results/gpu/compare.json. First, on any machine, the check that both sides build the
# same model from the same shape (on the meta device: no memory, no GPU); without a GPU it then
# says so and exits 0. See docs/gpu.md.
#
#   scripts/gpu-compare.sh [OUT]     OUT: the model, the text, the runs and their logs
#                                    (default: a temporary folder)
#
# GPU_COMPARE_STEPS (40), GPU_COMPARE_WARMUP (10), GPU_COMPARE_BATCH (4): each run's optimizer
# steps, how many of them are left out of the timing (the compiler's among them), sequences a step.
#
# torchtitan is pinned here, and goes into an environment of its own (BRIGADE_TITAN_ENV, by default
# ~/.cache/brigade/torchtitan-0.3.0), a venv layered over this Python's packages: it runs on the
# torch brigade runs on (pip is held to it) and brings its own dependencies (datasets, tyro, ...)
# without touching this environment, whose pins some of them would move (huggingface_hub, fsspec).
# Made once, then reused. brigade's side needs --compile and --float8 (issue 44) and torchao.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
TITAN=torchtitan==0.3.0
OUT=${1:-$(mktemp -d)}
STEPS=${GPU_COMPARE_STEPS:-40}
WARMUP=${GPU_COMPARE_WARMUP:-10}
BATCH=${GPU_COMPARE_BATCH:-4}
JSON=results/gpu/compare.json
ENV_DIR=${BRIGADE_TITAN_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/brigade/${TITAN/==/-}}
TPY=$ENV_DIR/bin/python
mkdir -p "$OUT" "$(dirname "$ENV_DIR")"

say() { echo "gpu-compare: $*"; }
fail() { echo "gpu-compare: $*" >&2; exit 1; }

# The venv's Python sees this Python's site directories after its own (a .pth file that adds them
# as Python adds its own, so that their editable installs count too): torch is this one's.
layer_over_this_python() {
    local purelib
    "$PY" -m venv "$ENV_DIR" || return 1
    purelib=$("$TPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") || return 1
    "$PY" - "$purelib/brigade-layered-over.pth" <<'EOF'
import sys
dirs = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
with open(sys.argv[1], "w", encoding="utf-8") as f:
    f.write("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")
EOF
}

titan_env() {  # torchtitan at the pinned version in ENV_DIR, on this Python's torch
    local torch have
    torch=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null) \
        || { say "$PY cannot import torch: run scripts/setup.sh first"; return 1; }
    if [ -x "$TPY" ] && [ "$("$TPY" -c 'import torch; print(torch.__version__)' 2>/dev/null)" != "$torch" ]; then
        say "$ENV_DIR sees another torch than $PY's $torch: remove it (rm -r $ENV_DIR) and run again"
        return 1
    fi
    have=$("$TPY" -c "import importlib.metadata as m; print(m.version('torchtitan'))" 2>/dev/null)
    [ "$have" = "${TITAN#*==}" ] && return 0
    [ -x "$TPY" ] || layer_over_this_python || { say "could not make a venv in $ENV_DIR"; return 1; }
    echo "torch==$torch" >"$ENV_DIR/torch-pin.txt"
    say "installing $TITAN into $ENV_DIR (once; torch held at $torch)"
    "$TPY" -m pip install --quiet -c "$ENV_DIR/torch-pin.txt" "$TITAN" >"$OUT/pip.log" 2>&1 \
        || { say "pip could not install $TITAN: see $OUT/pip.log"; return 1; }
}

# One at a time: two runs would make the environment at once.
if command -v flock >/dev/null; then exec 9>"$ENV_DIR.lock" && flock 9; fi
titan_env || exit 1

# The check, on any machine: both sides' models from one shape, torchtitan's reading of the runs'
# command line, its float8 layers. Its lines on stdout; stderr (library warnings, or the one line
# of what failed) in OUT/check.log.
if ! "$TPY" -m brigade.results.gpu_compare check "$OUT/model" --steps "$STEPS" --warmup "$WARMUP" \
        --batch "$BATCH" 2>"$OUT/check.log" | sed 's/^/gpu-compare: /'; then
    fail "the check failed: $(tail -n 1 "$OUT/check.log")"
fi

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    say "no GPU visible to torch: the check passed; the runs need CUDA, so $JSON is left as it was"
    exit 0
fi
"$PY" -c "import torchao" 2>/dev/null \
    || fail "torchao is not installed, which float8 needs on both sides: pip install -e '.[float8]'"
"$PY" -m brigade train --help | grep -q -- "--float8" \
    || fail "this brigade's train has no --compile and --float8 yet (issue 44): update it"
"$PY" -m brigade.results.gpu_compare prepare "$OUT/model" "$OUT/text" 2>"$OUT/prepare.log" \
    || fail "could not write the model and the text: $(tail -n 1 "$OUT/prepare.log")"
"$PY" -m brigade.results.gpu_compare run "$OUT" --titan-python "$TPY" --steps "$STEPS" \
    --warmup "$WARMUP" --batch "$BATCH" --json "$JSON"
