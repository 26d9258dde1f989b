"""A result a performer's worker thread hands over wakes the run's loop (`Loop.wake`): an
engine's install answer and a finished group are posted in the loop turn they arrive in, not
when that turn's wait runs out. The controller's agent socket, polled first, waited out its
whole 20 ms turn every time, so every hop of a publication (install answered → `installed`,
group answered → `complete` → the engine's next group) waited ~10 ms on average for nothing
(medians of a default run: 13 ms per install, 11 ms per group).

What is faked: the engine, at the HTTP layer (an `httpx.MockTransport` that answers at once),
and the controller's agent socket, by a first performer that waits on the loop's wake-up
descriptor as the socket's poll does and records whether a wake ended its wait. Nothing is
judged by time: a turn was woken when its wait found the wake-up readable, and the turns are
counted. The controller's own socket is checked to watch the wake-up (a real controller)."""

from __future__ import annotations

import dataclasses
import json
import select
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ehp_fsm import Orchestrator, load_plan
from ehp_fsm.core.transition import Command
from ehp_fsm.rollout import RevisionStore, SGLangClient
from ehp_fsm.rollout.dispatch import DispatchConfig, Dispatcher
from ehp_fsm.rollout.publish import PublishConfig, Publisher
from ehp_fsm.runtime.controller import Controller
from ehp_fsm.runtime.deliveries import FdReady
from ehp_fsm.shell.loop import Loop
from ehp_fsm.training.task import ArithmeticTask
from tests.rollout.hf import revision_state
from tests.runtime_system.harness import write_plan

PLAN = Path(__file__).resolve().parents[2] / "examples" / "local.toml"
#: a turn's wait: far longer than any answer here takes, so a turn that was not woken shows
TURN_S = 10.0

pytestmark = pytest.mark.timeout(120)


class Engine:
    """An engine that answers at once: installs, and `/generate` with sound samples once
    `generating` is set."""

    def __init__(self) -> None:
        self.version: str | None = None
        self.generating = threading.Event()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"null")
        if request.url.path == "/update_weights_from_disk":
            self.version = body.get("weight_version")
            return httpx.Response(200, json={"success": True, "message": "ok"})
        if request.url.path == "/generate":
            assert self.generating.wait(TURN_S)
            return httpx.Response(
                200,
                json=[
                    {
                        "text": "1",
                        "output_ids": [5, 2],
                        "meta_info": {
                            "id": rid,
                            "finish_reason": {"type": "stop"},
                            "weight_version": self.version,
                            "output_token_logprobs": [[-0.5, 5, None], [-0.1, 2, None]],
                        },
                    }
                    for rid in body["rid"]
                ],
            )
        if request.url.path == "/model_info":
            return httpx.Response(200, json={"weight_version": self.version})
        return httpx.Response(200, json={})


class AgentSocket:
    """The loop's first performer, standing in for the controller's agent socket: its turn
    waits on the loop's wake-up descriptor for up to the turn's timeout, and records whether
    a wake ended the wait (True) or the timeout did (False)."""

    routes: frozenset[tuple[str, str]] = frozenset()

    def __init__(self, loop: Loop) -> None:
        self.fd = loop.wake_fd()
        self.woken: list[bool] = []

    def perform(self, command: Command) -> None:
        raise AssertionError(f"no command is routed here: {command}")

    def poll(self, timeout_s: float) -> None:
        readable, _, _ = select.select([self.fd], [], [], timeout_s)
        self.woken.append(bool(readable))

    def close(self) -> None:
        return None


class Rig:
    """One engine serving revision 1, behind the run's publisher and dispatcher on one loop
    whose first performer is `AgentSocket`."""

    def __init__(self, root: Path, *, base: Path) -> None:
        self.base = base
        plan = load_plan(PLAN)
        plan = dataclasses.replace(plan, rollout=dataclasses.replace(plan.rollout, reserve=0))
        orch = Orchestrator.from_plan(plan, log_path=root / "t.jsonl", check=True)
        self.loop = Loop(orch, clock=time.monotonic)
        self.socket = AgentSocket(self.loop)
        self.pub = Publisher(
            self.loop,
            RevisionStore(root / "revisions"),
            config=PublishConfig(),
            wake=self.loop.wake,
        )
        self.disp = Dispatcher(
            self.loop,
            ArithmeticTask(),
            config=DispatchConfig(group_size=4, max_inflight_per_engine=4),
            wake=self.loop.wake,
        )
        for performer in (self.socket, self.pub, self.disp):
            self.loop.add(performer)
        self.save(1)
        assert self.pub.publish(1).accepted
        self.engine = Engine()
        client = SGLangClient("http://e0", transport=httpx.MockTransport(self.engine))
        out = self.loop.event(
            "rollout_engine", "e0", "launch", host="h1", gpus=["h1:g0"], tp=1, token="t"
        )
        assert out.accepted, out
        self.pub.attach("e0", client)
        self.disp.attach("e0", client)
        ident = {"host": "h1", "pid": 1, "start_time": 1.0, "token": "t"}
        assert self.pub.engine_healthy("e0", ident).accepted  # its install is under way
        assert self.turns_until(lambda: self.state() == "serving") == 1

    def save(self, revision: int) -> None:
        out = self.pub.save(
            revision=revision,
            step=revision,
            state_dict=revision_state(self.base, revision),
            base=self.base,
        )
        assert out.accepted, out

    def state(self) -> str:
        inst = self.loop.world.get("rollout_engine", "e0")
        assert inst is not None
        return str(inst.state)

    def turns_until(self, done: Any, most: int = 3) -> int:
        """Turn the loop (each turn's wait `TURN_S`) until `done()`; the turns it took, each
        of which must have been woken (not ended by its timeout)."""
        turns = 0
        while not done():
            assert turns < most, f"not done in {most} turns"
            self.loop.tick(TURN_S)
            turns += 1
        woken = self.socket.woken[-turns:] if turns else []
        assert all(woken), f"a turn waited out its timeout: {woken}"
        return turns

    def close(self) -> None:
        self.engine.generating.set()
        self.pub.close()
        self.disp.close()
        self.loop.close()


@pytest.fixture
def rig(tmp_path: Path, tiny_model: Path) -> Iterator[Rig]:
    r = Rig(tmp_path, base=tiny_model)
    try:
        yield r
    finally:
        r.close()


def test_an_install_is_reported_in_the_turn_its_answer_wakes(rig: Rig) -> None:
    rig.save(2)
    assert rig.pub.publish(2).accepted
    assert rig.state() == "updating"  # its install was sent
    assert rig.turns_until(lambda: rig.state() == "serving") == 1
    inst = rig.loop.world.get("rollout_engine", "e0")
    assert inst is not None and inst.get("installed") == 2


def test_a_finished_group_is_reported_in_the_turn_its_answer_wakes(rig: Rig) -> None:
    (gid,) = rig.disp.enqueue(1)
    rig.disp.pump()  # dispatched: its `/generate` is under way
    req = rig.loop.world.get("request", gid)
    assert req is not None and req.state == "dispatched"
    rig.engine.generating.set()  # the engine answers
    # The answer wakes a turn, which hands it to the dispatcher's scoring thread; its scores
    # wake the next turn (or reach the same one), which posts `complete`: every turn woken,
    # none waiting out its 10 s.
    assert rig.turns_until(lambda: rig.disp.completed_groups() == [gid]) in (1, 2)


def test_the_controllers_agent_socket_wait_ends_at_a_wake(tmp_path: Path) -> None:
    """The real controller's first performer waits on its agents' socket: that wait watches
    the loop's wake-up, so `Loop.wake` from another thread ends the turn."""
    plan_path, _ = write_plan(tmp_path)
    ctl = Controller.start(load_plan(plan_path), log_path=tmp_path / "t.jsonl")
    try:
        assert ctl.loop.performers[0] is ctl.link
        fd = ctl.loop.wake_fd()
        assert not any(isinstance(i, FdReady) for i in ctl.link.endpoint.poll(0.0))
        ctl.loop.wake()
        assert FdReady(fd=fd) in ctl.link.endpoint.poll(0.0)
        ctl.tick(0.0)  # the turn takes the wake-up (it would end the next turn's wait)
        assert not any(isinstance(i, FdReady) for i in ctl.link.endpoint.poll(0.0))
    finally:
        ctl.close()
