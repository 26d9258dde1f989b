#!/usr/bin/env bash
# Check benchmarks/gpu/wheels.txt: install exactly those wheels (--no-deps) into a clean venv
# that sees only the device image's packages (torch, transformers and their dependency closure,
# linked from IMAGE_SITE — a site-packages holding them), then import every module
# megatron_lanes_check.py uses and run its argument parser. Exit 0 when all import.
# Usage: benchmarks/gpu/check_wheels.sh WHEEL_DIR IMAGE_SITE
set -euo pipefail
cd "$(dirname "$0")/../.."
wheels="$1"; image="$2"
venv="$(mktemp -d)/venv"
python3 -m venv "$venv"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$image" > "$site/image.pth"
"$venv/bin/pip" install -q --no-index --no-deps "$wheels"/*.whl
PYTHONPATH=src "$venv/bin/python" -W ignore - <<'PYEOF'
import importlib
mods = [
    "torch", "transformers", "safetensors", "megatron.core", "mbridge", "einops", "pynvml",
    "ehp_fsm.backends.megatron.backend", "ehp_fsm.backends.megatron.hf",
    "ehp_fsm.backends.megatron.state", "ehp_fsm.backends.megatron.cpu",
    "ehp_fsm.models.tiny", "ehp_fsm.training.grpo", "ehp_fsm.training.lanes",
]
for m in mods:
    importlib.import_module(m)
import runpy, sys
sys.argv = ["megatron_lanes_check.py", "--help"]
try:
    runpy.run_path("benchmarks/gpu/megatron_lanes_check.py", run_name="__main__")
except SystemExit as e:
    assert e.code == 0, e.code
print(f"check_wheels: {len(mods)} modules import with the image's packages + the listed wheels")
PYEOF
