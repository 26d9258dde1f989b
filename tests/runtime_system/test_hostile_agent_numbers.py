"""An agent's news with a number the transition log cannot hold (NaN or infinity) is dropped
naming the field; it never reaches the orchestrator.

msgpack carries NaN and infinity, and the frame checks took any float where a process identity
has a start time. Such an identity reached `Orchestrator.handle` in the `healthy` event it
became, whose `EventError` ("JSON has no NaN or infinity") escaped `Controller.tick`: one frame
from the agent of the engine's host — an event, a reconcile, a report reply — ended the run.
The same for an entry's `labels.url`, which becomes the identity's `url`.

A real controller and a real agent endpoint over real sockets; the agent's frames are written by
the test. Each case leaves e0 starting, and the agent's well-formed report afterwards still
brings it up.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ehp_fsm.plan import load_plan
from ehp_fsm.runtime.controller import Controller
from ehp_fsm.runtime.deliveries import Received
from ehp_fsm.runtime.identity import capture
from ehp_fsm.runtime.protocol import Frame, Kind, encode
from ehp_fsm.runtime.transport import AgentEndpoint
from tests.runtime_system.harness import PLAN_BEAT, write_plan

pytestmark = pytest.mark.timeout(60)
NAN, INF = float("nan"), float("inf")


class Rig:
    """A controller and the agent of h1, whose engine e0 was launched and is starting."""

    def __init__(self, tmp_path: Path) -> None:
        plan_path, _ = write_plan(tmp_path)
        self.ctl = Controller.start(load_plan(plan_path), log_path=tmp_path / "t.jsonl")
        self.agent = AgentEndpoint(
            connect=self.ctl.endpoint.endpoint, host_id="h1", config=PLAN_BEAT
        )
        self.commands: list[Received] = []
        mine = capture(os.getpid(), launch_token="tok-e0")
        self.pid, self.start = mine.pid, mine.start_time

    def pump(self, n: int = 30) -> None:
        for _ in range(n):
            self.ctl.tick(0.005)  # raised EventError before the fix
            for it in self.agent.poll(0.002):
                if isinstance(it, Received) and it.frame.kind is Kind.COMMAND:
                    self.commands.append(it)

    def until(self, pred: Callable[[], bool], timeout_s: float = 10.0) -> None:
        end = time.monotonic() + timeout_s
        while not pred():
            assert time.monotonic() < end, "timed out"
            self.pump(1)

    def take(self, op: str) -> Received:
        self.until(lambda: any(c.frame.payload["op"] == op for c in self.commands))
        it = next(c for c in self.commands if c.frame.payload["op"] == op)
        self.commands.remove(it)
        return it

    def e0(self) -> str:
        inst = self.ctl.world.get("rollout_engine", "e0")
        assert inst is not None
        return inst.state

    def identity(self) -> dict[str, Any]:
        return {"host": "h1", "pid": self.pid, "start_time": self.start, "token": "tok-e0"}

    def entry(self, start_time: float | None = None, **labels: Any) -> dict[str, Any]:
        """A reconcile / report entry for e0's process."""
        return {
            "host": "h1",
            "pid": self.pid,
            "start_time": self.start if start_time is None else start_time,
            "launch_token": "tok-e0",
            "labels": {"machine": "rollout_engine", "instance": "e0", "phase": "running", **labels},
        }


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    try:
        r.agent.hello({"gpus": ["h1:g0"]})
        r.agent.reply(r.take("report"), ok=True, result={"processes": []})
        r.until(lambda: r.ctl.agents["h1"].reconciled)
        r.ctl.launch_engines(lambda eid: f"tok-{eid}")
        r.agent.reply(r.take("launch"), ok=True, result={"starting": True})
        r.pump()
        assert r.e0() == "starting"
        yield r
    finally:
        r.agent.close()
        r.ctl.close()


def still_served(r: Rig) -> None:
    """Nothing of the bad frame was applied, and the agent's good news is still heard."""
    assert r.e0() == "starting"
    ident = r.identity()
    r.agent.send_event(
        "healthy", {"machine": "rollout_engine", "instance": "e0", "identity": ident}
    )
    r.until(lambda: r.e0() == "installing")


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_a_healthy_event_with_a_start_time_that_is_not_finite_is_dropped(
    rig: Rig, bad: float
) -> None:
    ident = {**rig.identity(), "start_time": bad}
    rig.agent.send_event(
        "healthy", {"machine": "rollout_engine", "instance": "e0", "identity": ident}
    )
    rig.until(lambda: rig.ctl.drops["bad_contents"] >= 1)
    still_served(rig)


def test_a_reconcile_with_a_start_time_that_is_not_finite_is_dropped(rig: Rig) -> None:
    # (this side's frame checks refuse to build it now: the bytes a faulty agent would send)
    frame = Frame.unchecked(
        kind=Kind.RECONCILE,
        id="bad-reconcile",
        seq=10**6,
        epoch=rig.agent.epoch,
        sender="h1",
        payload={"processes": [rig.entry(start_time=NAN)]},
    )
    assert rig.agent._send_raw("controller", encode(frame))
    rig.until(lambda: rig.ctl.drops["wrong_type"] >= 1)  # dropped by the transport
    still_served(rig)


def test_a_reconcile_whose_url_label_is_not_text_is_dropped(rig: Rig) -> None:
    rig.agent.reconcile([rig.entry(url=NAN)])
    rig.until(lambda: rig.ctl.drops["bad_contents"] >= 1)
    still_served(rig)


def test_a_report_reply_with_a_start_time_that_is_not_finite_is_dropped(rig: Rig) -> None:
    rig.ctl.agents["h1"].reconciled = False  # as after a restart: the controller asks again
    rig.ctl.link.reconciler.ask_report("h1")
    rig.agent.reply(rig.take("report"), ok=True, result={"processes": [rig.entry(INF)]})
    rig.until(lambda: rig.ctl.drops["bad_contents"] >= 1)
    assert rig.e0() == "starting"
