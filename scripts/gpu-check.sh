#!/usr/bin/env bash
# Everything one GPU can show about brigade, in at most 10 minutes: one PASS or FAIL line per
# check, exit 1 if any failed. Needs CUDA and brigade installed (scripts/setup.sh).
#
#   scripts/gpu-check.sh [OUT]        OUT: where runs and logs go (default: a temporary folder)
#
# One GPU cannot show multi-rank NCCL pipelines (NCCL refuses two ranks on one device); on a
# machine with several GPUs, run `brigade check --stages 2` and `brigade train --nproc 2 --pp 2`
# as well. See docs/gpu.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
FAILED=0

check() {  # check NAME COMMAND...: PASS or FAIL on one line, the output in OUT/NAME.log
    local name=$1; shift
    local start=$SECONDS
    if "$@" >"$OUT/$name.log" 2>&1; then
        printf 'PASS  %-22s %3ds  %s\n' "$name" $((SECONDS - start)) "$(tail -n 1 "$OUT/$name.log")"
    else
        printf 'FAIL  %-22s %3ds  see %s\n' "$name" $((SECONDS - start)) "$OUT/$name.log"
        tail -n 5 "$OUT/$name.log" | sed 's/^/      /'
        FAILED=1
    fi
}

# GPU_CHECK_ON_CPU=1 runs the same steps on the CPU, to try the script itself without a GPU.
check versions "$PY" -c "
import os, torch
if os.environ.get('GPU_CHECK_ON_CPU'):
    print('on the CPU, by request (GPU_CHECK_ON_CPU=1)'); raise SystemExit
if not torch.cuda.is_available(): raise SystemExit('no GPU visible to torch')
print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| NCCL',
      '.'.join(map(str, torch.cuda.nccl.version())), '|', torch.cuda.get_device_name(0),
      '| bf16', torch.cuda.is_bf16_supported())"
if [ $FAILED -ne 0 ]; then echo "no usable GPU: nothing else to check"; exit 1; fi

TINY=(--n-layer 2 --n-embd 64 --n-head 2 --context 64 --block-size 64 --batch-size 16
      --eval-every 20 --eval-batches 2 --sample-tokens 0 --snapshot-every 10 --nproc 1)
hash_of() { "$PY" -m brigade inspect "$1" --json | "$PY" -c "import json,sys; print(json.load(sys.stdin)['params_sha256'])"; }
same_hash() {  # a run killed and resumed ends with the uninterrupted run's parameters, bit for bit
    local a b; a=$(hash_of "$1") && b=$(hash_of "$2") || return 1
    echo "params_sha256 ${a:0:16}… vs ${b:0:16}…"; [ "$a" = "$b" ]
}

check doctor          "$PY" -m brigade doctor --nproc 1 --out "$OUT/doctor"
# This GPU's profile for `brigade plan` (docs/plan.md, "A measured GPU profile"): a big bf16
# matmul's rate, a big copy's bandwidth, the allocator's reserve after a few steps, in
# OUT/gpu-profile.json; name it as profile = "..." in a --cluster file's [device] table.
[ -z "${GPU_CHECK_ON_CPU:-}" ] && check gpu-profile "$PY" -m brigade.planner.profile --out "$OUT/gpu-profile.json"
# The suite's GPU tier (tests/conftest.py): every test marked cuda, with the GPUs visible; its
# JUnit report in OUT/gpu/pytest-cuda.xml. On a GPU none may skip: a skip there is a GPU test
# that did not run (on the CPU, GPU_CHECK_ON_CPU=1, every one skips, saying why).
gpu_tests() {
    mkdir -p "$OUT/gpu"
    "$PY" -m pytest -m cuda -n 0 -p no:cacheprovider -rs --junitxml "$OUT/gpu/pytest-cuda.xml" tests || return 1
    if [ -z "${GPU_CHECK_ON_CPU:-}" ] && grep -q "<skipped" "$OUT/gpu/pytest-cuda.xml"; then
        echo "GPU tests skipped on the GPU (see above): they did not run"; return 1
    fi
}
check pytest-cuda gpu_tests
check check-nccl-1gpu "$PY" -m brigade check --model gpt --stages 1 --microbatches 4
GPU=cuda:0; [ -n "${GPU_CHECK_ON_CPU:-}" ] && GPU=cpu
check check-cpu+gpu   "$PY" -m brigade check --model gpt --stages 2 --runtime local --devices cpu,$GPU
check check-zb-cpu+gpu "$PY" -m brigade check --model gpt --stages 2 --runtime local --devices cpu,$GPU \
                        --schedule zb --microbatches 3
check check-v-1gpu     "$PY" -m brigade check --model gpt --stages 1 --virtual 2 --schedule interleaved \
                        --microbatches 4
check check-zbv-cpu+gpu "$PY" -m brigade check --model gpt --stages 2 --runtime local --devices cpu,$GPU \
                        --schedule zbv --microbatches 4
check check-dualpipev-gpu "$PY" -m brigade check --model gpt --stages 2 --runtime local --devices $GPU,$GPU \
                        --schedule dualpipev --microbatches 4
check check-resnet-gpu  "$PY" -m brigade check --model resnet50 --stages 2 --runtime local --devices $GPU,$GPU \
                        --schedule 1f1b --microbatches 4
check check-resnet-v-gpu "$PY" -m brigade check --model resnet50 --stages 2 --runtime local --devices $GPU,$GPU \
                        --schedule dualpipev --microbatches 4
check check-llama-gpu   "$PY" -m brigade check --model examples/llama.py:model --stages 2 --runtime local \
                        --devices cpu,$GPU --schedule interleaved --microbatches 3
check train-bf16      "$PY" -m brigade train "${TINY[@]}" --max-steps 40 --out "$OUT/straight"
check train-kill      "$PY" -m brigade train "${TINY[@]}" --max-steps 40 --out "$OUT/killed" \
                        --inject-fault kill:rank=0:step=25 --max-restarts 1
check resume-identical same_hash "$OUT/straight" "$OUT/killed"
# Snapshots are written in the background by default (state copied from the GPU to CPU memory
# first); written at once instead, the run must end on the same parameters.
check train-sync-snapshots "$PY" -m brigade train "${TINY[@]}" --max-steps 40 --out "$OUT/sync" \
                        --no-snapshot-async
check async-equals-sync same_hash "$OUT/straight" "$OUT/sync"
check kill-mid-snapshot "$PY" -m brigade train "${TINY[@]}" --max-steps 40 --out "$OUT/mid-snapshot" \
                        --inject-fault kill-during-snapshot:rank=0:step=20 --max-restarts 1
check mid-snapshot-identical same_hash "$OUT/straight" "$OUT/mid-snapshot"
check bf16-learns     "$PY" -c "
import json
rows = [json.loads(l) for l in open('$OUT/straight/metrics.jsonl')]
val = [r['val_loss'] for r in rows if 'val_loss' in r]
assert val[-1] < val[0], f'validation loss {val[0]:.3f} -> {val[-1]:.3f} did not fall'
print(f'validation loss {val[0]:.3f} -> {val[-1]:.3f}')"
# A Hugging Face directory (a tiny random Llama, written here) fine-tuned in bf16 on the GPU, its
# validation loss falling, and exported back (needs the hf extra, which scripts/setup.sh installs).
check hf-bf16-finetune "$PY" -c "
import json, subprocess, sys
run = lambda *a: subprocess.run([sys.executable, '-m', *a], check=True)
run('brigade.models.hf.tiny', '$OUT/tiny-llama')
run('brigade', 'train', '--model', 'hf:$OUT/tiny-llama', '--nproc', '1', '--block-size', '64',
    '--batch-size', '16', '--max-steps', '60', '--eval-every', '30', '--sample-tokens', '20',
    '--out', '$OUT/hf')
rows = [json.loads(l) for l in open('$OUT/hf/metrics.jsonl')]
val = [r['val_loss'] for r in rows if 'val_loss' in r]
assert val[-1] < val[0], f'validation loss {val[0]:.3f} -> {val[-1]:.3f} did not fall'
run('brigade', 'export', '--hf', '$OUT/hf-exported', '--from', '$OUT/hf')
print(f'validation loss {val[0]:.3f} -> {val[-1]:.3f}, exported')"
# Across processes: NCCL with one GPU per rank where there are two or more; with one GPU, the
# one-line refusal of two processes on it. GPU_CHECK_ON_CPU=1 runs the first branch on gloo.
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ -n "${GPU_CHECK_ON_CPU:-}" ] || [ "$GPUS" -ge 2 ]; then
    check check-2ranks-zb "$PY" -m brigade check --model gpt --stages 2 --schedule zb --microbatches 4
    check check-2ranks-dualpipev "$PY" -m brigade check --model gpt --stages 2 --schedule dualpipev \
                            --microbatches 4
    check check-dp2        "$PY" -m brigade check --model gpt --stages 1 --dp 2 --microbatches 2
    check train-pp2        "$PY" -m brigade train "${TINY[@]}" --nproc 2 --pp 2 --max-steps 20 --out "$OUT/pp2"
else
    refused() {  # the command exits 2 with one line on stderr that names the GPUs
        "$@" >/dev/null 2>"$OUT/refused.err"; local rc=$?; cat "$OUT/refused.err"
        [ $rc -eq 2 ] && [ "$(wc -l <"$OUT/refused.err")" -eq 1 ] && grep -q GPU "$OUT/refused.err"
    }
    check one-gpu-2procs   refused "$PY" -m brigade train "${TINY[@]}" --nproc 2 --pp 2 --out "$OUT/pp2"
fi
check step-time-mfu   "$PY" -m brigade.results.gpu --steps 30 --out "$OUT/gpu"
# context parallel: ring attention (CUDA only) and all-to-all, two processes on this GPU over gloo
check context-ring    "$PY" scripts/gpu_context.py "$OUT/context.json"

[ $FAILED -eq 0 ] && echo "gpu-check: all checks passed ($OUT)" || echo "gpu-check: some checks FAILED ($OUT)"
exit $FAILED
