"""An agent closed twice closes its own descriptors once: never another file's that took their
numbers since. Real descriptors, a real agent and controller endpoint."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ehp_fsm.runtime.agent import Agent, AgentConfig
from ehp_fsm.runtime.transport import ControllerEndpoint


def test_an_agent_closed_twice_closes_nothing_of_anyone_elses(tmp_path: Path) -> None:
    # The second close closed the wake pipe's descriptor numbers again; whatever had been
    # opened since held them (in a test process: another agent's ZeroMQ context, and libzmq
    # aborted the whole process).
    ctl = ControllerEndpoint(bind="tcp://127.0.0.1:*")
    agent = Agent(AgentConfig(controller=ctl.endpoint, host_id="h1", state_dir=tmp_path / "h1"))
    agent.close()
    opened = [fd for _ in range(64) for fd in os.pipe()]  # every number just freed, taken
    try:
        agent.close()
        closed = []
        for fd in opened:
            try:
                os.fstat(fd)
            except OSError:
                closed.append(fd)
        assert closed == []
    finally:
        for fd in opened:
            with contextlib.suppress(OSError):
                os.close(fd)
        ctl.close()
