"""Stateful property: over a real ROUTER/DEALER pair through a faulty proxy, effects happen once.

Hypothesis drives a controller and one agent (real pyzmq sockets on 127.0.0.1, a real
`FaultProxy` between them) with commands, events, agent work and clock jumps, under a random
drop/duplicate/delay/reorder schedule. Only time is fake: one hand-driven clock shared by both
endpoints and the proxy, so retries, deadlines and delays happen when the test says.

Properties: no command and no event ever takes effect twice; at the end (faults healed), every
command has exactly one outcome — a reply (and then it took effect exactly once) or a give-up
(at most once) — and every event was acknowledged (delivered exactly once) or given up on.

Example counts are lowered (25 examples × ≤ 15 steps) because each example opens and closes
real sockets and waits for loopback delivery; that keeps the CI profile under a minute.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ehp_fsm.runtime import (
    Acked,
    AgentEndpoint,
    ControllerEndpoint,
    FaultProxy,
    FaultSchedule,
    GaveUp,
    Incoming,
    Kind,
    Received,
    Replied,
    TransportConfig,
)
from ehp_fsm.runtime.endpoint import Endpoint
from tests.runtime.harness import FakeClock, Loop

# The fake clock jumps between polls (`advance`): every second of it counts, as it would not
# with own stalls discounted (tests/runtime/test_own_stalls.py covers that).
CFG = TransportConfig(
    retry_interval_s=0.1,
    deadline_s=3.0,
    heartbeat_interval_s=0.5,
    missed_heartbeats=4,
    discount_own_stalls=False,
)
ZERO_FAULTS = FaultSchedule()


class TransportMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.ctl: ControllerEndpoint | None = None
        self.agent: AgentEndpoint | None = None
        self.proxy: FaultProxy | None = None
        self.effects: Counter[str] = Counter()  # command id → times the agent acted
        self.events_seen: Counter[str] = Counter()  # event id → times the controller got it
        self.commands: list[str] = []
        self.events: list[str] = []
        self.inbox: list[Received] = []  # commands the agent has received, not yet acted on

    def _handle(self, endpoint: Endpoint, item: Incoming) -> None:
        if isinstance(item, Received) and item.frame.kind is Kind.COMMAND:
            assert endpoint is self.agent
            self.inbox.append(item)
        elif isinstance(item, Received) and item.frame.kind is Kind.EVENT:
            self.events_seen[item.frame.id] += 1

    @initialize(
        seed=st.integers(0, 2**16),
        drop=st.sampled_from([0.0, 0.1, 0.3]),
        duplicate=st.sampled_from([0.0, 0.2]),
        delay=st.sampled_from([0.0, 0.2]),
        reorder=st.sampled_from([0.0, 0.2]),
    )
    def start(self, seed: int, drop: float, duplicate: float, delay: float, reorder: float) -> None:
        self.ctl = ControllerEndpoint(config=CFG, clock=self.clock, epoch=1)
        schedule = FaultSchedule(
            seed=seed,
            drop=drop,
            duplicate=duplicate,
            delay=delay,
            reorder=reorder,
            delay_s=(0.05, 0.3),
        )
        self.proxy = FaultProxy(upstream=self.ctl.endpoint, clock=self.clock, schedule=schedule)
        self.agent = AgentEndpoint(
            connect=self.proxy.endpoint, host_id="a", config=CFG, clock=self.clock, epoch=1
        )
        self.loop = Loop([self.ctl, self.agent], proxy=self.proxy, handler=self._handle)
        # The controller only commands agents it has heard from: introduce without faults.
        self.proxy.set_schedule(ZERO_FAULTS)
        self.agent.hello({})
        self.loop.run_until(lambda: "a" in self.ctl.peers(), timeout_s=10)  # type: ignore[union-attr]
        self.proxy.set_schedule(schedule)

    def _settle(self) -> None:
        self.loop.settle(quiet_rounds=2, max_s=1.0)

    @rule(n=st.integers(1, 3))
    def send_commands(self, n: int) -> None:
        assert self.ctl is not None
        for i in range(n):
            self.commands.append(self.ctl.send_command("a", "apply", {"i": i}))
        self._settle()

    @rule()
    def send_event(self) -> None:
        assert self.agent is not None
        self.events.append(self.agent.send_event("tick", {}))
        self._settle()

    @rule()
    def agent_acts(self) -> None:
        assert self.agent is not None
        for item in self.inbox:
            self.effects[item.frame.id] += 1
            self.agent.reply(item, ok=True, result=None)
        self.inbox.clear()
        self._settle()

    @rule(dt=st.sampled_from([0.05, 0.1, 0.3, 1.0]))
    def time_passes(self, dt: float) -> None:
        self.clock.advance(dt)
        self._settle()

    @invariant()
    def nothing_takes_effect_twice(self) -> None:
        assert all(n == 1 for n in self.effects.values()), self.effects
        assert all(n == 1 for n in self.events_seen.values()), self.events_seen

    def teardown(self) -> None:
        try:
            if self.ctl is not None:
                self._finish()
        finally:
            for part in (self.agent, self.proxy, self.ctl):
                if part is not None:
                    part.close()

    def _finish(self) -> None:
        assert self.proxy is not None and self.agent is not None and self.ctl is not None
        self.proxy.set_schedule(ZERO_FAULTS)
        self.proxy.release_all()
        for _ in range(int(CFG.deadline_s / CFG.retry_interval_s) + 5):
            self.agent_acts()
            if self.ctl.in_flight == 0 and self.agent.in_flight == 0:
                break
            self.clock.advance(CFG.retry_interval_s)
        replied = Counter(r.msg_id for r in self.loop.of("controller", Replied))
        ctl_gave_up = Counter(g.msg_id for g in self.loop.of("controller", GaveUp))
        for msg_id in self.commands:
            outcomes = replied[msg_id] + ctl_gave_up[msg_id]
            assert outcomes == 1, f"command {msg_id}: {outcomes} outcomes"
            if replied[msg_id]:
                assert self.effects[msg_id] == 1, f"replied command {msg_id} not acted once"
            else:
                assert self.effects[msg_id] <= 1
        acked = {a.msg_id for a in self.loop.of("a", Acked) if a.kind is Kind.EVENT}
        agent_gave_up = {g.msg_id for g in self.loop.of("a", GaveUp)}
        for msg_id in self.events:
            assert (msg_id in acked) != (msg_id in agent_gave_up), msg_id
            if msg_id in acked:
                assert self.events_seen[msg_id] == 1
        self.nothing_takes_effect_twice()


TransportMachine.TestCase.settings = settings(
    TransportMachine.TestCase.settings,
    max_examples=min(settings().max_examples, 25),
    stateful_step_count=15,
    deadline=None,
)
TestTransport = pytest.mark.slow(pytest.mark.timeout(120)(TransportMachine.TestCase))
