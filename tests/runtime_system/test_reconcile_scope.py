"""An agent's report judges only the processes the agent runs. A Hybrid on the run's own warm
trainer workers (its launch routed to another performer) is no agent's process: an agent that
went silent and came back, reporting no process, must not fail it — seen in a default run whose
busy host agent missed its heartbeats: the borrowed Hybrid was failed "by reconcile".

Real controller and agent endpoint over real sockets; the warm-worker performer is the edge
faked (a few lines: it binds the Hybrid to this test process, as the run binds a warm worker).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from ehp_fsm.core.transition import Command
from ehp_fsm.plan import load_plan
from ehp_fsm.runtime.controller import Controller
from ehp_fsm.runtime.deliveries import Received
from ehp_fsm.runtime.identity import capture
from ehp_fsm.runtime.protocol import Kind
from ehp_fsm.runtime.transport import AgentEndpoint
from ehp_fsm.shell.loop import Route
from tests.runtime_system.harness import PLAN_BEAT, write_plan


class WarmWorkers:
    """Launches Hybrids on "warm workers" (this process) instead of through an agent."""

    routes: frozenset[Route] = frozenset(
        ("hybrid_replica", k) for k in ("launch", "load_state", "stop_process", "cancel_launch")
    )

    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl

    def perform(self, command: Command) -> None:
        if command.kind == "launch":
            me = capture(os.getpid(), launch_token=str(command.args["token"]))
            token = str(command.args["token"])
            ident = {"host": "h1", "pid": me.pid, "start_time": me.start_time, "token": token}
            self.ctl.event("hybrid_replica", command.instance, "launched", identity=ident)

    def poll(self, timeout_s: float) -> None:
        return None

    def close(self) -> None:
        return None


class FakeAgent:
    """The host agent h1 as its endpoint (real socket): the commands it gets, its answers."""

    def __init__(self, ctl: Controller, epoch: int | None = None) -> None:
        self.ctl = ctl
        self.endpoint = AgentEndpoint(
            connect=ctl.endpoint.endpoint, host_id="h1", epoch=epoch, config=PLAN_BEAT
        )
        self.got: list[Received] = []

    def pump(self, n: int = 30) -> None:
        for _ in range(n):
            self.ctl.tick(0.005)
            self.got.extend(
                it
                for it in self.endpoint.poll(0.005)
                if isinstance(it, Received) and it.frame.kind is Kind.COMMAND
            )

    def answer(self, op: str, result: dict[str, Any], *, within_s: float = 0.0) -> list[Received]:
        """Answer every `op` command it got (ok, `result`); those commands. `within_s`: pump
        until one came, for up to that long (a restarted agent's first command may wait for
        the controller to take its new connection: its routing id parked behind the old one's
        for a moment, "agent_unreachable", then the command is sent again)."""
        self.pump()
        end = time.monotonic() + within_s
        while time.monotonic() < end and not any(it.frame.payload["op"] == op for it in self.got):
            self.pump(5)
        mine = [it for it in self.got if it.frame.payload["op"] == op]
        for it in mine:
            self.got.remove(it)
            self.endpoint.reply(it, ok=True, result=result)
        self.pump()
        return mine


@pytest.mark.timeout(60)
@pytest.mark.parametrize("warm", [True, False])
def test_a_report_judges_only_the_agents_own_processes(tmp_path: Path, warm: bool) -> None:
    plan_path, _ = write_plan(tmp_path)
    ctl = Controller.start(load_plan(plan_path), log_path=tmp_path / "t.jsonl")
    if warm:
        ctl.loop.add(WarmWorkers(ctl))
    agent = FakeAgent(ctl)
    answer = agent.answer
    try:
        agent.endpoint.hello({"gpus": ["h1:g0"]})
        answer("report", {"processes": []})
        ctl.event("hybrid_replica", "x1", "request", reason="test")
        ctl.event("hybrid_replica", "x1", "allocate", host="h1", gpus=["h1:g0"])
        ctl.event("hybrid_replica", "x1", "launch", token="tok-x1")
        if not warm:  # the agent launched it; it reports the process up
            answer("launch", {"starting": True})
            me = capture(os.getpid(), launch_token="tok-x1")
            ident = {"host": "h1", "pid": me.pid, "start_time": me.start_time, "token": "tok-x1"}
            agent.endpoint.send_event(
                "launched", {"machine": "hybrid_replica", "instance": "x1", "identity": ident}
            )
            agent.pump()
        x1 = ctl.world.get("hybrid_replica", "x1")
        assert x1 is not None and x1.state == "loading", x1
        ctl.link.reconciler.on_silent("h1")  # silent a moment; back, it reports no process
        ctl.link.reconciler.ask_report("h1")
        answer("report", {"processes": []})
        x1 = ctl.world.get("hybrid_replica", "x1")
        assert x1 is not None
        if warm:  # no agent's business: untouched
            assert x1.state == "loading", (x1.state, x1.get("reason"))
        else:  # the agent's own process is gone: the Hybrid fails, as before
            assert x1.state == "failed" and "does not run its process" in x1.get("reason")
    finally:
        agent.endpoint.close()
        ctl.close()


class HoldingWarmWorkers(WarmWorkers):
    """Warm workers whose parked worker still holds its memory: the GPU finalizer is theirs
    (routed by the owner's machine) and they never confirm it."""

    routes: frozenset[Route] = WarmWorkers.routes | {("hybrid_replica", "confirm_gpu_free")}

    def __init__(self, ctl: Controller) -> None:
        super().__init__(ctl)
        self.asked: list[str] = []

    def perform(self, command: Command) -> None:
        if command.kind == "confirm_gpu_free":
            self.asked.append(command.instance)
            return
        super().perform(command)


@pytest.mark.timeout(60)
def test_a_hybrid_s_gpu_is_never_confirmed_free_by_its_host_s_agent(tmp_path: Path) -> None:
    """A Hybrid's GPU waits in `releasing` for its parked warm worker's measured report
    (`run.hybrids`). When its host's agent reported again (a reconnection), the reconciler sent
    that agent `confirm_gpu_free` for it too — and the agent, which runs no warm worker,
    confirmed it free while the worker still held its lane (seen with a Hybrid worker stopped
    by SIGSTOP). The agent's own engines' GPUs are still asked of it."""
    plan_path, _ = write_plan(tmp_path)
    ctl = Controller.start(load_plan(plan_path), log_path=tmp_path / "t.jsonl")
    warm = HoldingWarmWorkers(ctl)
    ctl.loop.add(warm)
    agent = FakeAgent(ctl)
    pump, answer = agent.pump, agent.answer
    try:
        agent.endpoint.hello({"gpus": ["h1:g0"]})
        answer("report", {"processes": []})
        ctl.event("hybrid_replica", "x1", "request", reason="test")
        ctl.event("hybrid_replica", "x1", "allocate", host="h1", gpus=["h1:g0"])
        ctl.event("hybrid_replica", "x1", "launch", token="tok-x1")
        gpu = ctl.world.get("gpu", "h1:g0")
        assert gpu is not None and gpu.get("owner") == "hybrid:x1", gpu
        assert ctl.event("hybrid_replica", "x1", "fail", reason="test").accepted
        pump()
        x1 = ctl.world.get("hybrid_replica", "x1")
        assert x1 is not None
        if x1.state not in ctl.world.specs["hybrid_replica"].terminal:  # its process ends
            ident = dict(x1.get("identity") or {})
            assert ctl.event("hybrid_replica", "x1", "exited", identity=ident).accepted, x1.state
            pump()
        gpu = ctl.world.get("gpu", "h1:g0")
        assert gpu is not None and gpu.state == "releasing", gpu
        assert warm.asked == ["h1:g0"]  # the finalizer went to the warm workers
        # the host's agent restarts (a new epoch): its hello, then its report of no process
        epoch = agent.endpoint.epoch
        agent.endpoint.close()
        agent = FakeAgent(ctl, epoch=epoch + 1)
        answer = agent.answer
        agent.endpoint.hello({"gpus": ["h1:g0"]})
        reported = answer("report", {"processes": []}, within_s=10.0)
        assert reported, "the restarted agent was not asked"
        asked = answer("confirm_gpu_free", {})
        assert not asked, [it.frame.payload for it in asked]  # never the agent's to confirm
        gpu = ctl.world.get("gpu", "h1:g0")
        assert gpu is not None and gpu.state == "releasing", gpu
    finally:
        agent.endpoint.close()
        ctl.close()
