"""An agent the controller never answers says so once, naming the two usual causes.

A second agent started for a host id another agent already holds (`srun` run twice, a copied
command line) is never answered: the controller's ROUTER hears one connection per routing id,
and the second one's frames never pass. It only logged reconnections ("unheard"), and the run's
error named no such agent. Real controller endpoint, two real agents, real sockets; the wait
before it speaks (`UNANSWERED_S`, 30 s) is shortened.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from ehp_fsm.runtime import agent as agent_module
from ehp_fsm.runtime.agent import Agent, AgentConfig

from .agent_rig import agent_rig


def test_a_second_agent_for_a_held_host_id_says_it_is_unanswered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_module, "UNANSWERED_S", 1.0)
    with agent_rig(tmp_path / "first") as rig:
        second = Agent(
            AgentConfig(controller=rig.ctl.endpoint, host_id="h1", state_dir=tmp_path / "second")
        )
        try:
            with capture_logs() as logs:
                end = time.monotonic() + 3.0
                while time.monotonic() < end:
                    rig.pump(0.02)
                    second.step(0.02)
            told = [e for e in logs if e["event"] == "controller_unanswered"]
            assert len(told) == 1, told  # once, and only by the second agent
            assert told[0]["epoch"] == second.endpoint.epoch != rig.agent.endpoint.epoch
            assert "no other agent runs as host 'h1'" in told[0]["fix"]
            assert rig.ctl.peers()["h1"].epoch == rig.agent.endpoint.epoch  # the first's
            assert rig.command("report", {}, seconds=1.0) is not None  # the first still served
        finally:
            second.close()
