#!/usr/bin/env bash
# Install brigade, its test tools and the optional Hugging Face and float8 extras into the current
# Python environment, at the exact versions the suite last passed with (constraints.txt; moved
# forward by scripts/update-pins.sh).
# torch comes first, and only if missing: a CPU-only machine then takes the CPU wheel
# instead of letting a plain "torch" requirement pull a CUDA build, and a GPU machine
# keeps the torch it has (which is why constraints.txt does not pin torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install --quiet "torch==${BRIGADE_TORCH_VERSION:-2.13.0}"
fi
# hf: the tests build tiny HF models; float8: they convert tiny models through torchao
"$PY" -m pip install --quiet -c constraints.txt -e ".[dev,hf,float8,data]"
