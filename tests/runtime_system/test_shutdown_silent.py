"""A controller shutdown with a silent agent does not claim a clean stop: the agent's engine was
asked to stop, but nothing confirmed it (real agents, engines and sockets; the agent is made
silent by SIGSTOP, as a hung host would be)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from ehp_fsm.plan import load_plan
from ehp_fsm.runtime.controller import Controller
from tests.runtime_system.driver import TEST_TRANSPORT, Driver, wait_agents
from tests.runtime_system.harness import AgentProc, cleanup, new_run_id, write_plan

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(150)
def test_a_shutdown_with_a_silent_agent_is_not_reported_clean(tmp_path: Path) -> None:
    plan_path, endpoint = write_plan(tmp_path)
    log_path = tmp_path / "transitions.jsonl"
    run_id = new_run_id()
    ctl = Controller.start(
        load_plan(plan_path), log_path=log_path, bind=endpoint, transport=TEST_TRANSPORT
    )
    agents = [
        AgentProc(host=h, endpoint=endpoint, tmp=tmp_path, run_id=run_id) for h in ("h1", "h2")
    ]
    with cleanup(run_id, agents, [ctl]):
        wait_agents(ctl, ["h1", "h2"])
        Driver(ctl).setup()
        assert ctl.run_until(
            lambda c: all(
                c.world.get("rollout_engine", e).state == "serving" for e in ("e0", "e1")
            ),
            90.0,
        ), [a.tail() for a in agents]
        os.kill(agents[1].pid, signal.SIGSTOP)  # h2's agent hangs; its engine e1 runs on
        try:
            assert ctl.run_until(lambda c: c.agents["h2"].silent, 20.0)
            assert ctl.shutdown(timeout_s=5.0) is False
        finally:
            os.kill(agents[1].pid, signal.SIGCONT)
        assert ctl.world.get("gpu", "h2:g0").state == "quarantined"  # never confirmed free
        assert ctl.unconfirmed_hosts() == ["h2"]
        assert ctl.world.get("gpu", "h1:g0").state == "free"  # h1 confirmed its engine's exit
