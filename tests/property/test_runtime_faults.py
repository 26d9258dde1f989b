"""Stateful property: a controller and two agents through random faults keep the ledger sound.

Hypothesis drives a real `Controller` (with its transition log) and two real `Agent` objects
over real loopback sockets through a `FaultProxy`, towards a borrow or a return (the world-driven
`Driver` of the system tests), while it kills processes with SIGKILL, crashes agents (the agent
object is dropped without stopping its processes, as a kill -9 would; a new incarnation adopts
them from the state file), partitions an agent, and turns message faults on and off.

Deliberate simplifications (each said here): the agents run in this process (objects, stepped
by the test loop) rather than as separate processes, and engines are the idle stand-in process
(`workers.engine_standin_argv`) — the processes they launch, watch, stop and adopt are real.

Invariants after every step: the engine's safety invariants (one owner per GPU, ledger adds up,
complete one-host allocations, install-before-serve). At the end, with faults healed and crashed
agents restarted: everything settles (no GPU releasing or quarantined), every owned GPU's owner
is live with its process running, no process of the run is orphaned, every group is accounted
for, and the log replays to the same world.

Example count: 6 examples × ≤ 6 steps. One example starts a controller, two agents, a proxy and
several real processes, and each step waits on real time (retries, heartbeats, process starts);
this keeps the ci profile well under 90 s.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ehp_fsm.core.invariants import check_invariants
from ehp_fsm.plan import load_plan
from ehp_fsm.runtime import FaultProxy, FaultSchedule
from ehp_fsm.runtime.agent import Agent, AgentConfig
from ehp_fsm.runtime.controller import Controller
from ehp_fsm.runtime.workers import WorkerRegistry
from tests.runtime_system.driver import TEST_TRANSPORT, Driver
from tests.runtime_system.harness import (
    final_checks,
    kill_run,
    live_instances,
    new_run_id,
    run_processes,
    write_plan,
)

HOSTS = ("h1", "h2")


class RuntimeFaults(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self._tmp = TemporaryDirectory(prefix="ehp-rtf-")
        self.tmp = Path(self._tmp.name)
        self.run_id = new_run_id()
        os.environ["EHP_TEST_RUN"] = self.run_id  # inherited by every process the agents start
        plan_path, endpoint = write_plan(self.tmp)
        self.log_path = self.tmp / "transitions.jsonl"
        self.ctl = Controller.start(
            load_plan(plan_path), log_path=self.log_path, bind=endpoint, transport=TEST_TRANSPORT
        )
        self.proxy = FaultProxy(upstream=endpoint, schedule=FaultSchedule(seed=1))
        self.proxy.start()
        self.agents: dict[str, Agent | None] = {h: self._agent(h) for h in HOSTS}
        self.driver = Driver(self.ctl, prefix="h")
        self.goal = "serving"
        self.cut: set[str] = set()
        self.popens: list[subprocess.Popen[bytes]] = []  # children of crashed agents, to reap
        # The agents are objects stepped by `_loop` (a bare `ctl.run_until` would not step
        # them): wait, stepping everyone, until both have said hello *and* reconciled.
        assert self._loop(self._reconciled, 30.0), f"agents did not reconcile: {self.ctl.agents}"
        self.driver.setup()

    def _reconciled(self) -> bool:
        agents = self.ctl.agents
        return all(h in agents and agents[h].reconciled for h in HOSTS)

    def _no_strays(self) -> bool:
        """Every process of this run belongs to a live instance (stops finished)."""
        live = live_instances(self.ctl)
        return all(p.pid in live for p in run_processes(self.run_id))

    def _agent(self, host: str) -> Agent:
        config = AgentConfig(
            controller=self.proxy.endpoint,
            host_id=host,
            slots=1,
            device="cpu",
            state_dir=self.tmp / f"agent-{host}",
            transport=TEST_TRANSPORT,
            stop_grace_s=3.0,
        )
        return Agent(config, workers=WorkerRegistry.from_names(["rollout_engine"]))

    def _loop(self, done: object, seconds: float, *, advance: bool = False) -> bool:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if callable(done) and done():
                return True
            if advance:
                self.driver.advance(self.goal)
            self.ctl.tick(0.01)
            for agent in self.agents.values():
                if agent is not None:
                    agent.step(0.0)
        return False

    # -- rules -------------------------------------------------------------------------------
    @rule(goal=st.sampled_from(["borrowed", "serving"]), seconds=st.sampled_from([0.3, 1.0]))
    def drive(self, goal: str, seconds: float) -> None:
        self.goal = goal
        self._loop(None, seconds, advance=True)

    @rule(index=st.integers(0, 3))
    def kill_a_process(self, index: int) -> None:
        procs = self.ctl.owned_processes()
        if procs:
            _, _, ident = procs[index % len(procs)]
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(ident["pid"]), 9)

    @rule(host=st.sampled_from(HOSTS))
    def crash_agent(self, host: str) -> None:
        agent = self.agents[host]
        if agent is not None:
            self._keep_popens(agent)
            agent.close()  # like kill -9: its processes keep running, its state file stays
            self.agents[host] = None

    def _keep_popens(self, agent: Agent) -> None:
        self.popens += [m.popen for m in agent.managed.values() if m.popen is not None]

    @precondition(lambda self: any(a is None for a in self.agents.values()))
    @rule()
    def restart_agents(self) -> None:
        for host, agent in self.agents.items():
            if agent is None:
                self.agents[host] = self._agent(host)

    @rule(host=st.sampled_from(HOSTS), cut=st.booleans())
    def partition(self, host: str, cut: bool) -> None:
        self.proxy.partition(host, cut=cut)
        (self.cut.add if cut else self.cut.discard)(host)

    @rule(seed=st.integers(0, 1000), rate=st.sampled_from([0.0, 0.05, 0.15]))
    def message_faults(self, seed: int, rate: float) -> None:
        self.proxy.set_schedule(
            FaultSchedule(seed=seed, drop=rate, duplicate=rate, delay=rate, reorder=rate)
        )

    @invariant()
    def safety(self) -> None:
        assert check_invariants(self.ctl.world) == []

    def teardown(self) -> None:
        try:
            self.proxy.set_schedule(FaultSchedule(seed=0))
            for host in list(self.cut):
                self.proxy.partition(host, cut=False)
            if any(a is None for a in self.agents.values()):
                self.restart_agents()
            self.goal = "serving"
            assert self._loop(lambda: self.driver.reached("serving"), 60.0, advance=True)

            def quiet() -> bool:
                states = {g.state for g in self.ctl.world.of("gpu").values()}
                return not ({"releasing", "quarantined"} & states) and self.ctl.link.settled()

            # Conditions, not a pause: everything settled *and* every stray process stopped
            # (its agent, stepped here, must see the stop and the exit). final_checks' own
            # waits tick only the controller.
            assert self._loop(lambda: quiet() and self._reconciled(), 30.0), self.ctl.agents
            assert self._loop(lambda: quiet() and self._no_strays(), 30.0), (
                f"strays: {[p.pid for p in run_processes(self.run_id)]}, "
                f"live: {live_instances(self.ctl)}"
            )
            final_checks(self.ctl, self.run_id, self.log_path)
        finally:
            for agent in self.agents.values():
                if agent is not None:
                    self._keep_popens(agent)
                    agent.close()
            self.ctl.close()
            self.proxy.stop()
            self.proxy.close()
            kill_run(self.run_id)
            for popen in self.popens:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.kill()
                    popen.wait(5)
            os.environ.pop("EHP_TEST_RUN", None)
            self._tmp.cleanup()


RuntimeFaults.TestCase.settings = settings(
    RuntimeFaults.TestCase.settings,
    max_examples=min(settings().max_examples, 6),
    stateful_step_count=6,
    deadline=None,
)
TestRuntimeFaults = pytest.mark.slow(pytest.mark.timeout(240)(RuntimeFaults.TestCase))
