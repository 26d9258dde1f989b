#!/usr/bin/env bash
# GPU check of the Megatron-Core backend (CUDA + NCCL, ~0.73B GPTModel, random init).
# Runs benchmarks/gpu/megatron_check.py (restore exactness, next-update exactness, bug (b),
# DP-zero transfer bandwidth vs a plain device-to-host copy), then the GPU-marked pytest tests.
# Budget: under 10 minutes on one H200. Needs torch with CUDA and megatron-core 0.16.1 installed
# (`pip install -e '.[dev,megatron]'`); nothing is downloaded at run time.
# Usage: benchmarks/gpu/megatron_check.sh [--small] [--layers N --hidden H --heads A]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
nvidia-smi -L || { echo "megatron_check.sh: no nvidia-smi / GPU" >&2; exit 2; }
"$PY" - <<'PYEOF'
import sys
import torch
import megatron.core
print(f"torch {torch.__version__} cuda={torch.cuda.is_available()} "
      f"megatron-core {megatron.core.__version__}")
sys.exit(0 if torch.cuda.is_available() else 2)
PYEOF
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
timeout 480 "$PY" benchmarks/gpu/megatron_check.py "$@"
timeout 90 "$PY" -m pytest tests/megatron -m gpu -x -q -p no:cacheprovider
echo "megatron_check.sh: done in $(( $(date +%s) - start ))s"
