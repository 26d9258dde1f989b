"""A malformed command gets a refusal naming what was wrong, and the agent goes on serving
(real agent, real controller endpoint, real sockets): an exception that escaped a command used
to end the agent's loop, and its shutdown stopped every process on the host."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ehp_fsm.runtime.agent import Agent, AgentConfig
from ehp_fsm.runtime.deliveries import Replied
from ehp_fsm.runtime.transport import ControllerEndpoint


@pytest.mark.timeout(60)
def test_a_malformed_command_is_refused_and_the_agent_goes_on(tmp_path: Path) -> None:
    ctl = ControllerEndpoint(bind="tcp://127.0.0.1:*")
    agent = Agent(AgentConfig(controller=ctl.endpoint, host_id="h1", state_dir=tmp_path))
    replies: dict[str, Replied] = {}

    def pump(until: float) -> None:
        while time.monotonic() < until:
            for item in ctl.poll(0.01):
                if isinstance(item, Replied):
                    replies[item.msg_id] = item
            agent.step(0.01)

    try:
        end = time.monotonic() + 10
        while "h1" not in ctl.peers() and time.monotonic() < end:
            pump(time.monotonic() + 0.05)
        assert "h1" in ctl.peers()
        bad = ctl.send_command("h1", "stop_process", {"identity": "not-a-map"})
        pump(time.monotonic() + 1.0)  # raised out of the agent's loop before the fix
        assert bad in replies and replies[bad].ok is False
        assert replies[bad].result["reason"] == "bad_args"
        assert "AttributeError" in replies[bad].result["detail"]
        good = ctl.send_command("h1", "report", {})
        pump(time.monotonic() + 1.0)
        assert good in replies and replies[good].ok is True  # still serving
    finally:
        agent.close()
        ctl.close()
