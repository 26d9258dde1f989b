"""An agent whose controller is gone stops what it launched once the controller's lease on it
runs out (`--orphan-after-s`), and stays up, idle, for a controller that comes back.

Real agent processes and a real controller process, killed with SIGKILL (nothing can stop its
processes for it); the stand-in engines and the Hybrid are real processes the agents launched.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.runtime_system.harness import AgentProc, cleanup, new_run_id, run_processes, write_plan
from tests.runtime_system.test_faults import STANDIN, _spawn_controller, _wait_line

LEASE_S = 3.0


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_agents_stop_their_processes_when_the_controller_is_gone(tmp_path: Path) -> None:
    plan_path, endpoint = write_plan(tmp_path)
    log = tmp_path / "transitions.jsonl"
    run_id = new_run_id()
    agents = [
        AgentProc(
            host=h,
            endpoint=endpoint,
            tmp=tmp_path,
            run_id=run_id,
            standin=STANDIN,
            extra=["--orphan-after-s", str(LEASE_S)],
        )
        for h in ("h1", "h2")
    ]
    proc = _spawn_controller(tmp_path, plan_path, log, endpoint, "borrowed")
    with cleanup(run_id, agents):
        try:
            _wait_line(proc, "REACHED", 100.0)
            assert len(run_processes(run_id)) == 2  # the Hybrid on h1, engine e1 on h2
        finally:
            proc.kill()  # kill -9: the controller stops nothing
            proc.wait(10)
            assert proc.stdout is not None
            proc.stdout.close()
        killed = time.monotonic()
        assert len(run_processes(run_id)) == 2, "still running right after the kill"
        deadline = killed + LEASE_S + 5.0 + 20.0  # lease + stop grace + a loaded machine
        while run_processes(run_id) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert run_processes(run_id) == [], [a.tail() for a in agents]
        assert time.monotonic() - killed >= LEASE_S - 0.5, "not before the lease ran out"
        for a in agents:
            assert a.proc is not None and a.proc.poll() is None, "the agent itself stays up"
            assert "controller_gone_stopping_processes" in a.tail(200)
            assert a.terminate() == 0
