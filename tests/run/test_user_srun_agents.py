"""An operator's `--agents external` mistakes, with agents started as srun starts them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ehp_fsm.rollout.launch import free_port
from tests.run.test_external_agents import slurm_plan, srun_agent
from tests.run.test_run import assert_no_orphans


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_agent_whose_host_id_is_not_in_the_plan_is_named_by_the_run(tmp_path: Path) -> None:
    """The third node's agent takes a node name the plan does not have (its [[hosts]] id is
    `node-03`, its $SLURMD_NODENAME `node-09`): its hello is refused. The run said only that
    node-03 "did not connect" and to see the agents' output, which showed a handshake that
    succeeded; it names the agent it refused now, and the id to start it with."""
    run_id = uuid.uuid4().hex
    port = free_port()

    def short_wait(text: str) -> str:
        return text + "\n[deadlines.run]\nagents_connect = 10\n"

    plan, log, _ = slurm_plan(tmp_path, port, steps=2, edit=short_wait)
    env = {**os.environ, "EHP_TEST_RUN": run_id}
    argv = [sys.executable, "-m", "ehp_fsm.cli", "run", str(plan), "--agents", "external"]
    run = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    agents = [
        srun_agent(node, port, tmp_path, run_id, i, plan, slots=1)
        for i, node in enumerate(("node-01", "node-02", "node-09"))
    ]
    try:
        out, _ = run.communicate(timeout=90)
    finally:
        for a in agents:
            a.send_signal(signal.SIGTERM)
        for a in agents:
            a.communicate(timeout=30)
    assert run.returncode == 2, out
    assert "the host agents ['node-03'] did not connect within 10 s" in out, out
    assert "agents of hosts the plan does not have connected and were refused: ['node-09']" in out
    assert "start each agent with a [[hosts]] id of the plan" in out, out
    assert "$SLURMD_NODENAME" in out, out
    assert not (log.parent / "agents").exists(), "the run started no agent of its own"
    assert_no_orphans(run_id)
