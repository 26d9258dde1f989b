#!/usr/bin/env bash
# Run the rollout contract suite (tests/rollout/test_contract.py) against a real SGLang server.
#
#   benchmarks/gpu/sglang_contract.sh MODEL_PATH [PORT]
#
# MODEL_PATH: a small local HF model folder (e.g. Qwen2.5-0.5B-Instruct); it is both served and
# reloaded by the /update_weights_from_disk tests. Needs a CUDA GPU and `pip install sglang`.
# The server is started here, waited for with a deadline, and always stopped on exit.
set -euo pipefail

MODEL_PATH="${1:?usage: $0 MODEL_PATH [PORT]}"
PORT="${2:-30123}"
HOST=127.0.0.1
URL="http://${HOST}:${PORT}"
PYTHON="${PYTHON:-python}"
DEADLINE_S="${SGLANG_START_DEADLINE_S:-600}"
LOG="${OUT:-/tmp}/sglang-contract-server.log"
cd "$(dirname "$0")/../.."

export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c "import sglang; print('sglang', sglang.__version__)"
# The command line an agent gives SGLang, from the one builder (src/ehp_fsm/engine_command.py):
# model path, TP 1, host, port, weight version, deterministic inference, then extra arguments.
mapfile -t CMD < <("$PYTHON" - "$MODEL_PATH" "$HOST" "$PORT" <<'PY'
import sys

from ehp_fsm.engine_command import EngineCommand, engine_argv

model, host, port = sys.argv[1:4]
cmd = EngineCommand(
    model_path=model,
    weight_version="1",
    host=host,
    port=int(port),
    deterministic=True,
    extra_args=("--mem-fraction-static", "0.5", "--log-level", "warning"),
)
print("\n".join(engine_argv(cmd, backend="sglang", python=sys.executable)))
PY
)
echo "starting: ${CMD[*]}"
"${CMD[@]}" >"$LOG" 2>&1 &
SERVER_PID=$!
cleanup() {
    if kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -TERM "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 1 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
        kill -KILL "$SERVER_PID" 2>/dev/null || true
    fi
}
trap cleanup EXIT

start=$(date +%s)
until curl -fsS "${URL}/health_generate" >/dev/null 2>&1; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
        echo "sglang server exited before becoming healthy; last log lines:" >&2
        tail -n 40 "$LOG" >&2
        exit 1
    fi
    if (( $(date +%s) - start > DEADLINE_S )); then
        echo "sglang server not healthy after ${DEADLINE_S}s; last log lines:" >&2
        tail -n 40 "$LOG" >&2
        exit 1
    fi
    sleep 2
done
echo "sglang server healthy after $(( $(date +%s) - start ))s at ${URL}"

EHP_SGLANG_URL="$URL" EHP_SGLANG_MODEL_PATH="$MODEL_PATH" \
    "$PYTHON" -m pytest tests/rollout/test_contract.py -q -p no:cacheprovider \
    -o timeout=600 "${@:3}"
