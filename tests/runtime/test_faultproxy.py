"""Retries + dedup through a lossy, duplicating, reordering proxy: each effect exactly once."""

from __future__ import annotations

import time

import pytest

from ehp_fsm.runtime import (
    Acked,
    AgentEndpoint,
    ControllerEndpoint,
    FaultProxy,
    FaultSchedule,
    GaveUp,
    Kind,
    PeerReturned,
    PeerSilent,
    Received,
    Replied,
    TransportConfig,
    TransportError,
)
from tests.runtime.harness import Loop, auto_reply

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

# Real time, short timers: the proxy's delays (≤ 30 ms) are shorter than a retry (50 ms).
CFG = TransportConfig(
    retry_interval_s=0.05, deadline_s=20.0, heartbeat_interval_s=0.1, missed_heartbeats=3
)
NASTY = FaultSchedule(
    seed=7, drop=0.2, duplicate=0.15, delay=0.15, reorder=0.15, delay_s=(0.001, 0.03)
)


def test_every_command_and_event_takes_effect_exactly_once_through_faults() -> None:
    effects: dict[str, int] = {}
    with ControllerEndpoint(config=CFG, epoch=1) as ctl:
        proxy = FaultProxy(upstream=ctl.endpoint, schedule=NASTY)
        agents = [
            AgentEndpoint(connect=proxy.endpoint, host_id=f"h{i}", config=CFG, epoch=1)
            for i in range(2)
        ]
        loop = Loop([ctl, *agents], proxy=proxy, handler=auto_reply(effects))
        hellos = [a.hello({"n": i}) for i, a in enumerate(agents)]
        loop.run_until(
            lambda: {h.frame.id for h in loop.of("controller", Received)} >= set(hellos),
            timeout_s=20,
        )
        commands = [ctl.send_command(f"h{i % 2}", "op", {"i": i}) for i in range(40)]
        events = [a.send_event("tick", {"i": i}) for i in range(20) for a in agents]
        loop.run_until(
            lambda: (
                len(loop.of("controller", Replied)) == len(commands)
                and all(a.in_flight == 0 for a in agents)
            ),
            timeout_s=40,
        )
        assert sorted(r.msg_id for r in loop.of("controller", Replied)) == sorted(commands)
        assert effects == dict.fromkeys(commands, 1)  # acted once each, never twice
        got_events = [
            r.frame.id for r in loop.of("controller", Received) if r.frame.kind is Kind.EVENT
        ]
        assert sorted(got_events) == sorted(events)  # each event delivered exactly once
        assert not loop.of("controller", GaveUp)
        # The faults really happened, in both directions.
        for fault in ("dropped", "duplicated", "delayed", "reordered"):
            assert proxy.counts[f"up_{fault}"] > 0 and proxy.counts[f"down_{fault}"] > 0, fault
        assert sum(a.stats["duplicates"] for a in agents) > 0 and ctl.stats["duplicates"] > 0
        for a in agents:
            a.close()
        proxy.close()


def test_a_partitioned_agent_goes_silent_and_returns_when_healed() -> None:
    with ControllerEndpoint(config=CFG, epoch=1) as ctl:
        proxy = FaultProxy(upstream=ctl.endpoint)
        with AgentEndpoint(connect=proxy.endpoint, host_id="h0", config=CFG) as agent:
            loop = Loop([ctl, agent], proxy=proxy, handler=auto_reply())
            hello = agent.hello({})
            loop.run_until(lambda: any(a.msg_id == hello for a in loop.of("h0", Acked)))
            proxy.partition("h0")
            cut_at = time.monotonic()
            pending = ctl.send_command("h0", "stop", {})
            loop.run_until(lambda: bool(loop.of("controller", PeerSilent)), timeout_s=5)
            silent_after = time.monotonic() - cut_at
            assert silent_after >= CFG.heartbeat_interval_s * (CFG.missed_heartbeats - 1)
            # The agent notices too: the controller is silent from its side.
            loop.run_until(lambda: bool(loop.of("h0", PeerSilent)), timeout_s=5)
            proxy.partition("h0", cut=False)
            loop.run_until(
                lambda: (
                    bool(loop.of("controller", PeerReturned))
                    and any(r.msg_id == pending for r in loop.of("controller", Replied))
                ),
                timeout_s=5,
            )
            assert proxy.counts["up_partitioned"] > 0 and proxy.counts["down_partitioned"] > 0
        proxy.close()


def test_background_relay_and_schedule_validation() -> None:
    with pytest.raises(TransportError, match="more than 1"):
        FaultSchedule(drop=0.6, duplicate=0.6)
    with pytest.raises(TransportError, match="loopback"):
        FaultProxy(upstream="tcp://127.0.0.1:1", bind="tcp://0.0.0.0:*")
    with ControllerEndpoint(config=CFG) as ctl, FaultProxy(upstream=ctl.endpoint) as proxy:
        proxy.start()
        with AgentEndpoint(connect=proxy.endpoint, host_id="h0", config=CFG) as agent:
            loop = Loop([ctl, agent], handler=auto_reply())
            msg_id = agent.send_event("x", {})
            loop.run_until(lambda: any(a.msg_id == msg_id for a in loop.of("h0", Acked)))
        proxy.stop()
        assert proxy.counts["up_forwarded"] >= 1
