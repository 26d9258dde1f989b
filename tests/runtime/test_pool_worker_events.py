"""The controller's side of agent-launched pool workers: the run asks a host's agent for a pool
rank and hears `launched` / `launch_failed` / `exited` as `PoolWorkerEvent`s — never as events
of the state machines — and an agent's report gets every pool worker no live launch of the
current pool wants stopped (a fresh controller, after the run restarted, knows none).

Real controller, real sockets, the real reconciler; the agent is the edge faked: a bare agent
endpoint the test answers for (so it can report what a real agent reports after a restart,
a stale worker among it). `test_pool_worker_launch` drives a real agent and real workers."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ehp_fsm.plan import load_plan
from ehp_fsm.runtime.controller import Controller, ControllerError
from ehp_fsm.runtime.deliveries import Received
from ehp_fsm.runtime.identity import capture
from ehp_fsm.runtime.pool_launch import TrainerLaunch
from ehp_fsm.runtime.pool_workers import PoolWorkerEvent, PoolWorkersError
from ehp_fsm.runtime.protocol import Kind
from ehp_fsm.runtime.transport import AgentEndpoint
from ehp_fsm.training.pool import PoolConfig, TrainerPool
from tests.runtime_system.harness import PLAN_BEAT, write_plan


class FakeAgent:
    """Agent h1's endpoint, answered by the test; the controller ticked alongside."""

    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl
        self.ep = AgentEndpoint(connect=ctl.endpoint.endpoint, host_id="h1", config=PLAN_BEAT)
        self.commands: list[Received] = []
        self.running: dict[str, dict[str, Any]] = {}  # token -> its report entry (`up`)

    def pump(self, n: int = 30) -> None:
        for _ in range(n):
            self.ctl.tick(0.005)
            self.commands.extend(
                it
                for it in self.ep.poll(0.005)
                if isinstance(it, Received) and it.frame.kind is Kind.COMMAND
            )

    def take(self, op: str) -> Received:
        """The first `op` command, within 10 s. A `report` met while waiting for another op is
        answered as a real agent would, with what it runs: the controller asks for a report
        again when one was given up (overdue on a loaded machine) or judged stale, and holds
        its commands to the agent until one is answered. A CI run met a `report` where its
        `launch` was awaited (once; not reproduced, even with the test process stalled 3 s)."""
        end = time.monotonic() + 10.0
        while time.monotonic() < end:
            for it in self.commands:
                if it.frame.payload["op"] == op:
                    self.commands.remove(it)
                    return it
                if it.frame.payload["op"] == "report":
                    self.commands.remove(it)
                    self.ep.reply(it, ok=True, result={"processes": list(self.running.values())})
                    break
            self.pump(5)
        raise AssertionError(f"no {op} command; got {[c.frame.payload for c in self.commands]}")

    def answer(self, op: str, result: dict[str, Any], ok: bool = True) -> dict[str, Any]:
        cmd = self.take(op)
        self.ep.reply(cmd, ok=ok, result=result)
        self.pump()
        args: dict[str, Any] = cmd.frame.payload["args"]
        return args

    def event(self, name: str, data: dict[str, Any]) -> None:
        self.ep.send_event(name, data)
        self.pump()


def identity(token: str) -> dict[str, Any]:
    me = capture(os.getpid(), launch_token=token)
    return {"host": "h1", "pid": me.pid, "start_time": me.start_time, "token": token}


def entry(token: str) -> dict[str, Any]:
    """A reconcile entry as a real agent reports a running pool worker."""
    ident = identity(token)
    return {
        "host": "h1",
        "pid": ident["pid"],
        "start_time": ident["start_time"],
        "launch_token": token,
        "labels": {
            "machine": "pool_worker",
            "instance": "pool-r1",
            "role": "pool_worker",
            "gpus": [],
            "phase": "running",
        },
    }


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[tuple[Controller, FakeAgent, TrainerPool]]:
    plan_path, _ = write_plan(tmp_path)
    ctl = Controller.start(load_plan(plan_path), log_path=tmp_path / "t.jsonl")
    agent = FakeAgent(ctl)
    pool = TrainerPool.bind(PoolConfig(core_dp=1, max_hybrids=1), work_dir=tmp_path / "pool")
    try:
        agent.ep.hello({"gpus": ["h1:g0"]})
        agent.answer("report", {"processes": []})
        yield ctl, agent, pool
    finally:
        pool.shutdown(timeout_s=1.0)
        agent.ep.close()
        ctl.close()


def up(ctl: Controller, agent: FakeAgent, pool: TrainerPool, token: str) -> dict[str, Any]:
    """Launch rank 1 under `token`; the agent starts it and says so."""
    ctl.launch_pool_worker("h1", TrainerLaunch.for_pool(pool, 1), token)
    args = agent.answer("launch", {"starting": True})
    assert args["trainer"] == TrainerLaunch.for_pool(pool, 1).to_wire()
    assert (args["machine"], args["role"], args["token"]) == ("pool_worker",) * 2 + (token,)
    ident = identity(token)
    agent.event("launched", {"machine": "pool_worker", "instance": "pool-r1", "identity": ident})
    agent.running[token] = entry(token)
    return ident


@pytest.mark.timeout(60)
def test_pool_worker_news_reaches_the_run_and_not_the_state_machines(
    rig: tuple[Controller, FakeAgent, TrainerPool],
) -> None:
    ctl, agent, pool = rig
    heard: list[PoolWorkerEvent] = []
    ctl.on_pool_worker(heard.append)
    world = ctl.world.snapshot()

    ident = up(ctl, agent, pool, "tok-a-0001")
    assert heard == [
        PoolWorkerEvent(
            kind="launched",
            host="h1",
            rank=1,
            token="tok-a-0001",
            pool_token=pool.launch_token,
            identity=ident,
        )
    ]
    agent.event(
        "exited",
        {
            "machine": "pool_worker",
            "instance": "pool-r1",
            "identity": ident,
            "returncode": -9,
            "stopped": False,
        },
    )
    assert heard[-1].kind == "exited" and heard[-1].returncode == -9 and not heard[-1].stopped

    # refused by the agent: launch_failed, with the agent's reason
    ctl.launch_pool_worker("h1", TrainerLaunch.for_pool(pool, 1, standby=True), "tok-b-0001")
    agent.answer("launch", {"reason": "bad_trainer", "detail": "trainer.x is refused"}, ok=False)
    assert heard[-1].kind == "launch_failed" and heard[-1].token == "tok-b-0001"
    assert "bad_trainer: trainer.x is refused" in heard[-1].reason

    # the run stops one: by its identity
    ident_c = up(ctl, agent, pool, "tok-c-0001")
    assert ctl.stop_pool_worker("tok-c-0001") and not ctl.stop_pool_worker("tok-c-0001")
    assert agent.answer("stop_process", {"stopping": True})["identity"] == ident_c

    assert [e.kind for e in ctl.pool_worker_events()] == [e.kind for e in heard]
    assert ctl.pool_worker_events() == []
    assert ctl.world.snapshot() == world  # no machine heard of any of it
    assert not ctl.rejected and not ctl.link.refused and not ctl.drops
    with pytest.raises(PoolWorkersError, match="used already"):
        ctl.launch_pool_worker("h1", TrainerLaunch.for_pool(pool, 1), "tok-c-0001")
    with pytest.raises(ControllerError, match="not a host of the plan"):
        ctl.launch_pool_worker("h9", TrainerLaunch.for_pool(pool, 1), "tok-d-0001")


@pytest.mark.timeout(60)
def test_a_report_stops_the_pool_workers_no_live_pool_asked_for(
    rig: tuple[Controller, FakeAgent, TrainerPool], tmp_path: Path
) -> None:
    ctl, agent, pool = rig
    kept = up(ctl, agent, pool, "tok-kept-01")
    up(ctl, agent, pool, "tok-lost-01")
    ctl.pool_worker_events()
    # The agent was silent a moment; back, it reports the worker it kept, not the one that
    # died meanwhile, and one of a run before this one (the controller never launched it).
    ctl.link.reconciler.on_silent("h1")
    ctl.link.reconciler.ask_report("h1")
    agent.answer("report", {"processes": [entry("tok-kept-01"), entry("tok-stale-1")]})
    stop = agent.take("stop_process").frame.payload["args"]
    assert stop["machine"] == "pool_worker" and stop["identity"]["token"] == "tok-stale-1"
    assert not [c for c in agent.commands if c.frame.payload["op"] == "stop_process"]
    events = ctl.pool_worker_events()
    assert [(e.kind, e.token) for e in events] == [("exited", "tok-lost-01")]
    assert "does not run it" in events[0].reason and events[0].returncode is None
    assert ctl.pool_workers.launches["tok-kept-01"].identity == kept

    # A run that restarted has a fresh controller and a new pool: every pool worker its
    # agent still runs is stopped, the one it kept before included.
    ctl.close()
    (tmp_path / "again").mkdir()
    plan_path, _ = write_plan(tmp_path / "again")
    fresh = Controller.start(load_plan(plan_path), log_path=tmp_path / "t2.jsonl")
    again = FakeAgent(fresh)
    try:
        again.ep.hello({"gpus": ["h1:g0"]})
        again.answer("report", {"processes": [entry("tok-kept-01")]})
        stop = again.take("stop_process").frame.payload["args"]
        assert stop["identity"]["token"] == "tok-kept-01"
        assert fresh.pool_worker_events() == []
    finally:
        again.ep.close()
        fresh.close()


@pytest.mark.timeout(60)
def test_a_retired_pools_workers_are_stopped_and_a_new_pool_may_launch(
    rig: tuple[Controller, FakeAgent, TrainerPool], tmp_path: Path
) -> None:
    ctl, agent, pool = rig
    ident = up(ctl, agent, pool, "tok-old-001")
    other = TrainerPool.bind(PoolConfig(core_dp=1, max_hybrids=1), work_dir=tmp_path / "p2")
    try:
        with pytest.raises(PoolWorkersError, match="another pool"):
            ctl.launch_pool_worker("h1", TrainerLaunch.for_pool(other, 1), "tok-new-001")
        # stopped before its process was known: by its token (this agent never got the launch)
        ctl.launch_pool_worker("h1", TrainerLaunch.for_pool(pool, 1), "tok-early-1")
        agent.take("launch")  # lost on its way
        assert ctl.retire_pool() == ["tok-old-001", "tok-early-1"]
        assert agent.answer("stop_process", {"stopping": True})["identity"] == ident
        assert agent.answer("cancel_launch", {"cancelled": "not_running"})["token"] == "tok-early-1"
        assert [(e.kind, e.token, e.stopped) for e in ctl.pool_worker_events()] == [
            ("launched", "tok-old-001", False),
            ("exited", "tok-early-1", True),
        ]
        ctl.launch_pool_worker("h1", TrainerLaunch.for_pool(other, 1), "tok-new-001")
        assert agent.answer("launch", {"starting": True})["trainer"]["pool_token"] == (
            other.launch_token
        )
    finally:
        other.shutdown(timeout_s=1.0)
