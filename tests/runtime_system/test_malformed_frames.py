"""Frames whose envelope is valid but whose contents have the wrong shape (a faulty or hostile
agent) are dropped with the field that was wrong (`runtime.messages`), counted and logged; the
controller goes on, and a well-formed agent is still served (real controller, real agent
endpoints, real sockets). The controller's own handling never meets a wrong shape: before the
checks, a hello with `gpus=5` raised out of `tick()`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from ehp_fsm.plan import load_plan
from ehp_fsm.runtime.controller import Controller
from ehp_fsm.runtime.messages import event_problem, inventory_problem, report_problem
from ehp_fsm.runtime.transport import AgentEndpoint
from tests.runtime_system.harness import write_plan

IDENT = {"host": "h1", "pid": 4242, "start_time": 1.5, "token": "tok"}


@pytest.mark.parametrize(
    ("name", "data", "expected"),
    [
        ("healthy", {"machine": "rollout_engine", "instance": "e0", "identity": IDENT}, None),
        ("healthy", {"machine": "rollout_engine", "instance": "e0"}, "healthy.identity"),
        (
            "exited",
            {
                "machine": "rollout_engine",
                "instance": "e0",
                "identity": {**IDENT, "pid": "4242"},
                "returncode": None,
                "stopped": True,
            },
            "exited.identity.pid is str",
        ),
        ("gpu_free", {"gpu": "h1:g0", "owner": 3, "processes_exited": True}, "owner is int"),
        ("launch_failed", {"machine": "m", "instance": "i", "token": "t", "reason": "r"}, None),
        ("tick", {}, "unknown_event"),
    ],
)
def test_event_shapes(name: str, data: dict[str, Any], expected: str | None) -> None:
    problem = event_problem(name, data)
    assert problem is None if expected is None else expected in str(problem), problem


def test_inventory_and_report_shapes() -> None:
    assert inventory_problem({"gpus": ["h1:g0"], "device": "cpu"}) is None
    assert "inventory.gpus is int" in str(inventory_problem({"gpus": 5}))
    assert "inventory.gpus[1] is int" in str(inventory_problem({"gpus": ["h1:g0", 1]}))
    assert "unknown keys" in str(inventory_problem({"gpus": [], "colour": "red"}))
    assert report_problem({"processes": []}) is None
    assert "report result is list" in str(report_problem([]))
    entry = {"host": "h1", "pid": 1, "start_time": 1.0, "launch_token": "t", "labels": {}}
    assert report_problem({"processes": [entry]}) is None
    assert "launch_token is missing" in str(
        report_problem({"processes": [{k: v for k, v in entry.items() if k != "launch_token"}]})
    )


@pytest.mark.timeout(60)
def test_malformed_contents_are_dropped_and_the_controller_goes_on(tmp_path: Path) -> None:
    plan_path, _ = write_plan(tmp_path)
    ctl = Controller.start(load_plan(plan_path), log_path=tmp_path / "t.jsonl")
    bad = AgentEndpoint(connect=ctl.endpoint.endpoint, host_id="h1")
    good = AgentEndpoint(connect=ctl.endpoint.endpoint, host_id="h2")
    try:
        bad.hello({"gpus": 5})  # not a list of GPU ids
        bad.send_event("exited", {"machine": "rollout_engine", "instance": "e0", "identity": 7})
        end = time.monotonic() + 15
        while time.monotonic() < end and ctl.drops["bad_contents"] < 2:
            ctl.tick(0.01)
            bad.poll(0.0)
        assert ctl.drops["bad_contents"] >= 2  # the hello and the event (a retry may add one)
        assert "h1" not in ctl.agents  # nothing of the bad hello was applied
        good.hello({"gpus": ["h2:g0"]})
        end = time.monotonic() + 15
        while "h2" not in ctl.agents and time.monotonic() < end:
            ctl.tick(0.01)
            good.poll(0.0)  # retries the hello if it went out before the connection was up
            bad.poll(0.0)
        assert "h2" in ctl.agents
    finally:
        bad.close()
        good.close()
        ctl.close()
