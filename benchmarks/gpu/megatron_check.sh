#!/usr/bin/env bash
# GPU check of the Megatron-Core backend (CUDA + NCCL, ~0.78B GPTModel, random init).
# Runs benchmarks/gpu/megatron_check.py (restore exactness, next-update exactness, bug (b),
# DP-zero transfer bandwidth vs a plain device-to-host copy), then the GPU-marked pytest tests.
# Budget: under 10 minutes on one H200 (timeouts below: 480 s + 90 s).
#
# Needs torch with CUDA plus megatron-core 0.16.1 and structlog; nothing is downloaded at run
# time. On a machine whose Python lacks the last two (the lent H200 image: Python 3.12, torch
# 2.11, no megatron-core/structlog), carry their wheels in $WHEELS (default .whl, git-ignored
# by the caller), fetched beforehand on a machine with pip:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1 structlog
# (megatron-core needs only torch, numpy and packaging, which that image has.)
# Usage: benchmarks/gpu/megatron_check.sh [--small] [--layers N --hidden H --heads A]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
nvidia-smi -L || { echo "megatron_check.sh: no nvidia-smi / GPU" >&2; exit 2; }
WHEELS="${WHEELS:-.whl}"
if ! "$PY" -c "import megatron.core, structlog" 2>/dev/null; then
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/ehp_site "$WHEELS"/*.whl
    export PYTHONPATH="/tmp/ehp_site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "megatron_check.sh: megatron-core/structlog missing and no wheels in $WHEELS" >&2
    exit 2
  fi
fi
"$PY" - <<'PYEOF'
import sys
import torch
import megatron.core
print(f"python {sys.version.split()[0]} torch {torch.__version__} "
      f"cuda={torch.cuda.is_available()} megatron-core {megatron.core.__version__}")
sys.exit(0 if torch.cuda.is_available() else 2)
PYEOF
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
start=$(date +%s)
timeout 480 "$PY" benchmarks/gpu/megatron_check.py "$@"
timeout 90 "$PY" -m pytest tests/megatron -m gpu -x -q -p no:cacheprovider
echo "megatron_check.sh: done in $(( $(date +%s) - start ))s"
