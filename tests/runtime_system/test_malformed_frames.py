"""Frames whose envelope is valid but whose inner values have the wrong shape (a faulty or
hostile agent) are dropped with an error log; the controller goes on, and a well-formed agent
is still served (real controller, real agent endpoint, real sockets)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ehp_fsm.plan import load_plan
from ehp_fsm.runtime.controller import Controller
from ehp_fsm.runtime.transport import AgentEndpoint
from tests.runtime_system.harness import write_plan


@pytest.mark.timeout(60)
def test_a_hello_with_a_malformed_inventory_does_not_stop_the_controller(tmp_path: Path) -> None:
    plan_path, _ = write_plan(tmp_path)
    ctl = Controller.start(load_plan(plan_path), log_path=tmp_path / "t.jsonl")
    bad = AgentEndpoint(connect=ctl.endpoint.endpoint, host_id="h1")
    good = AgentEndpoint(connect=ctl.endpoint.endpoint, host_id="h2")
    try:
        bad.hello({"gpus": 5})  # not a list of GPU ids: raised out of tick() before
        end = time.monotonic() + 2
        while time.monotonic() < end:
            ctl.tick(0.01)
            bad.poll(0.0)
        good.hello({"gpus": ["h2:g0"]})
        assert ctl.run_until(lambda c: "h2" in c.agents, 10.0)
    finally:
        bad.close()
        good.close()
        ctl.close()
