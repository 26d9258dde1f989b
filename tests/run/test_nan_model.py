"""A model the engines cannot sample from (a NaN in its weights: every sample aborted).

Before, `check` passed it and the run said nothing past "3 engines serving revision 1" for the
300 s of `[deadlines.run] rollout`, while it dispatched and aborted ~400 groups a second, each
logged (77,137 `abort` records, 67 MB of log in 190 s). Now a group whose answer is a failure
waits before it is sent again, as a refused one does (`Dispatcher._refused`), and 10 s into a
step's rollout with only failed dispatches the run says what the engines answer. A real run
(`ehp-fsm run` in a subprocess) of the short plan with one embedding row set to NaN.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.run.test_run import plan_text, session_model

ROLLOUT_S = 14  # past the run's 10 s (`job.ROLLOUT_QUIET_S`), short of a long test


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_model_whose_samples_all_abort_is_said_early_and_not_dispatched_in_a_hot_loop(
    tmp_path: Path,
) -> None:
    model = tmp_path / "nan-model"
    shutil.copytree(session_model(), model)
    (weights,) = model.glob("*.safetensors")
    tensors = load_file(weights)
    name = next(k for k in tensors if "embed_tokens" in k)
    tensors[name][:] = float("nan")  # every token's embedding: every sample's logits
    save_file(tensors, weights, metadata={"format": "pt"})
    log = tmp_path / "run" / "transitions.jsonl"
    plan = tmp_path / "plan.toml"
    text = plan_text(log, 2).replace(str(session_model()), str(model))
    plan.write_text(text + f"\n[deadlines.run]\nrollout = {ROLLOUT_S}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "ehp_fsm.cli", "run", str(plan)],
        capture_output=True,
        text=True,
        timeout=200,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "step 1: no group completed in 10 s;" in out, out
    assert "dispatches failed, the last: engine e" in out, out
    assert f"rollout did not produce 4 groups in {ROLLOUT_S} s" in out, out
    aborts = sum(
        1 for line in log.read_text().splitlines() if json.loads(line).get("event") == "abort"
    )
    # 8 groups in flight, each re-sent after 0.01, 0.02, ... up to 1 s: at most ~20 a group
    assert 1 <= aborts <= 200, aborts
