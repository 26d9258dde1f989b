"""A `report` reply that was lost and answered again from the agent's memory is a snapshot
older than events the controller already handled: it must not be applied (it would fail an
engine launched since), and a fresh report is asked for.

Real controller and agent endpoint over real sockets; what is faked: the network losing one
reply frame (the agent endpoint's raw send drops it), and the agent's answers are written by
the test, so that the report is made before the launch is acted on.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ehp_fsm.plan import load_plan
from ehp_fsm.runtime.controller import Controller
from ehp_fsm.runtime.deliveries import Received
from ehp_fsm.runtime.identity import capture
from ehp_fsm.runtime.protocol import Kind, decode
from ehp_fsm.runtime.transport import AgentEndpoint
from tests.runtime_system.harness import PLAN_BEAT, write_plan


class Wire:
    """The test's agent end: what it hears from the controller, turned by `pump`."""

    def __init__(self, ctl: Controller, agent: AgentEndpoint) -> None:
        self.ctl, self.agent = ctl, agent
        self.commands: list[Received] = []

    def pump(self, n: int = 30) -> None:
        for _ in range(n):
            self.ctl.tick(0.005)
            for it in self.agent.poll(0.005):
                if isinstance(it, Received) and it.frame.kind is Kind.COMMAND:
                    self.commands.append(it)

    def take(self, op: str) -> Received:
        self.pump()
        for it in list(self.commands):
            if it.frame.payload["op"] == op:
                self.commands.remove(it)
                return it
        raise AssertionError(f"no {op} command")


@pytest.mark.timeout(60)
def test_a_report_answered_again_from_memory_is_not_applied(tmp_path: Path) -> None:
    plan_path, _ = write_plan(tmp_path)
    ctl = Controller.start(load_plan(plan_path), log_path=tmp_path / "t.jsonl")
    agent = AgentEndpoint(connect=ctl.endpoint.endpoint, host_id="h1", config=PLAN_BEAT)
    lose_next_reply = [False]
    send = agent._send_raw

    def lossy(peer: Any, data: bytes) -> Any:
        if lose_next_reply[0] and decode(data).kind is Kind.REPLY:
            lose_next_reply[0] = False
            return True  # "sent", and lost on the way
        return send(peer, data)

    agent._send_raw = lossy  # type: ignore[method-assign]
    wire = Wire(ctl, agent)
    pump, take, commands = wire.pump, wire.take, wire.commands

    try:
        agent.hello({"gpus": ["h1:g0"]})
        agent.reply(take("report"), ok=True, result={"processes": []})
        pump()
        ctl.launch_engines(lambda eid: f"tok-{eid}")
        launch = take("launch")
        # the agent went quiet a moment; back, it is asked for a report
        ctl.link.reconciler.on_silent("h1")
        ctl.link.reconciler.ask_report("h1")
        report = take("report")
        lose_next_reply[0] = True
        agent.reply(report, ok=True, result={"processes": []})  # made before the launch
        agent.reply(launch, ok=True, result={"starting": True})
        mine = capture(os.getpid(), launch_token="tok-e0")
        ident = {"host": "h1", "pid": mine.pid, "start_time": mine.start_time, "token": "tok-e0"}
        healthy = {"machine": "rollout_engine", "instance": "e0", "identity": ident}
        agent.send_event("healthy", healthy)
        pump(200)  # the controller retries the report; the agent answers it from its memory
        e0 = ctl.world.get("rollout_engine", "e0")
        assert e0 is not None and e0.state == "installing", e0
        assert any(c.frame.payload["op"] == "report" for c in commands)  # asked anew
    finally:
        agent.close()
        ctl.close()


@pytest.mark.timeout(60)
def test_a_start_up_reconcile_overtaken_by_a_report_and_a_launch_reply_is_not_applied(
    tmp_path: Path,
) -> None:
    """Seen in CI through the lossy-network proxy: the agent's own start-up reconcile ("no
    processes") was delayed past the report the controller asked for at its hello and past the
    agent's reply to a launch; applied, it failed the engine the agent had just started. Here the
    network holds that reconcile (and its retransmissions) until the launch is answered."""
    plan_path, _ = write_plan(tmp_path)
    ctl = Controller.start(load_plan(plan_path), log_path=tmp_path / "t.jsonl")
    agent = AgentEndpoint(connect=ctl.endpoint.endpoint, host_id="h1", config=PLAN_BEAT)
    held: list[tuple[Any, bytes]] = []
    holding = [True]
    send = agent._send_raw

    def delaying(peer: Any, data: bytes) -> Any:
        if holding[0] and decode(data).kind is Kind.RECONCILE:
            held.append((peer, data))
            return True  # on its way, slowly
        return send(peer, data)

    agent._send_raw = delaying  # type: ignore[method-assign]
    wire = Wire(ctl, agent)
    pump, take, commands = wire.pump, wire.take, wire.commands

    try:
        agent.hello({"gpus": ["h1:g0"]})
        agent.reconcile([])  # the start-up snapshot: held by the network
        agent.reply(take("report"), ok=True, result={"processes": []})
        pump()
        ctl.launch_engines(lambda eid: f"tok-{eid}")
        launch = take("launch")
        agent.reply(launch, ok=True, result={"starting": True})
        pump()
        assert held, "the test's network held no reconcile"
        holding[0] = False
        send(*held[0])  # the old snapshot arrives now, before the agent's `healthy`
        pump()
        e0 = ctl.world.get("rollout_engine", "e0")
        assert e0 is not None and e0.state == "starting", e0
        mine = capture(os.getpid(), launch_token="tok-e0")
        ident = {"host": "h1", "pid": mine.pid, "start_time": mine.start_time, "token": "tok-e0"}
        healthy = {"machine": "rollout_engine", "instance": "e0", "identity": ident}
        agent.send_event("healthy", healthy)
        pump(100)
        e0 = ctl.world.get("rollout_engine", "e0")
        assert e0 is not None and e0.state == "installing", e0
        assert not any(c.frame.payload["op"] == "cancel_launch" for c in commands)
    finally:
        agent.close()
        ctl.close()
