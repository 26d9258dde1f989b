"""`transport.curve = "local"`: a one-machine run makes CURVE keys for its own agents (one per
host id, bound to it) and the whole run takes the authenticated path — the controller's CURVE
server refuses any agent that does not present its own host's key, so a run that ends clean
proves every agent authenticated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ehp_fsm.errors import PlanError
from ehp_fsm.plan import load_plan
from tests.run.test_run import assert_no_orphans, plan_text


def curve_plan(tmp: Path, transport_extra: str) -> Path:
    log = tmp / "run" / "transitions.jsonl"
    text = plan_text(log, 2).replace(
        'controller = "tcp://127.0.0.1:*"', f'controller = "tcp://127.0.0.1:*"\n{transport_extra}'
    )
    assert transport_extra in text
    path = tmp / "plan.toml"
    path.write_text(text)
    return path


def test_local_curve_is_refused_beside_keys_or_a_non_loopback_plane(tmp_path: Path) -> None:
    for extra in ('curve = "local"\ncurve_keys = "k"', 'curve = "on"'):
        with pytest.raises(PlanError, match=r"transport\.curve"):
            load_plan(curve_plan(tmp_path, extra))
    assert load_plan(curve_plan(tmp_path, 'curve = "local"')).transport.curve == "local"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_local_run_with_curve_keys_runs_clean(tmp_path: Path) -> None:
    plan = curve_plan(tmp_path, 'curve = "local"')
    run_id = uuid.uuid4().hex
    proc = subprocess.run(
        [sys.executable, "-m", "ehp_fsm.cli", "run", str(plan)],
        capture_output=True,
        text=True,
        env={**os.environ, "EHP_TEST_RUN": run_id},
        timeout=360,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    run_dir = tmp_path / "run"
    receipt = json.loads((run_dir / "receipt.json").read_text())
    assert receipt["clean_controller"] is True and receipt["last_step"] == 2
    bound = json.loads((run_dir / "keys" / "hosts.json").read_text())
    assert sorted(bound) == ["h0", "h1", "h2"]
    assert_no_orphans(run_id)
