#!/usr/bin/env bash
# Issue 15's GPU check in one short lease (one H200, well under 10 minutes):
#   1. benchmarks/gpu/megatron_lanes_check.py: Megatron Core + Hybrid lane on one GPU, generated
#      ~0.44B Qwen3-architecture model in bf16 through mbridge (restore and next update bit-exact,
#      DP-zero transfer vs a plain D2H copy, Adam temporaries on CUDA, NVML after parking);
#   2. the `gpu`-marked tests (tests/megatron/test_gpu_check.py, tests/training/test_memory_gpu.py).
# The device image has torch + CUDA and transformers; the rest travels as the wheels listed in
# benchmarks/gpu/wheels.txt, in $WHEELS (default .whl; check the list first with
# benchmarks/gpu/check_wheels.sh). Logs go to $OUT (the device tool's folder) or /tmp.
# Usage: benchmarks/gpu/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/device_check}"
mkdir -p "$OUT"
WHEELS="${WHEELS:-.whl}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
start=$(date +%s)
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/ehp_site "$WHEELS"/*.whl || exit 2
  export PYTHONPATH="src:/tmp/ehp_site"
  "$PY" -c 'import sys, torch, transformers, megatron.core, mbridge; print("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "megatron-core", megatron.core.__version__, "cuda", torch.cuda.is_available())'
  echo "== megatron_lanes_check"
  timeout 330 "$PY" -W ignore benchmarks/gpu/megatron_lanes_check.py --timeout 300
  echo "lanes rc=$?"
  echo "== gpu-marked tests"
  timeout 200 "$PY" -m pytest -o addopts="" -p no:cacheprovider -W ignore -m gpu -q -rA \
    tests/megatron/test_gpu_check.py tests/training/test_memory_gpu.py
  echo "pytest rc=$?"
  echo "device_check.sh: done in $(( $(date +%s) - start ))s"
} 2>&1 | tee "$OUT/device_check.log"
