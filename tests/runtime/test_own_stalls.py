"""An endpoint's own stalls (its process stopped by SIGSTOP, a paused VM, a blocked caller) do
not count against its peers: `TransportConfig.discount_own_stalls`, `Stalled`.

Before, a controller stopped for 20 s took every agent for silent at its resume (their GPUs
quarantined, "host h1: its agent went silent" printed for each), before it had read the
heartbeats waiting in its socket, and a command whose answer waited there was given up. Real
sockets; the clock is fake (advanced without polling: the stall), and the whole-run form with a
real SIGSTOP is `tests/run/test_controller_frozen.py`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ehp_fsm.runtime import (
    AgentEndpoint,
    ControllerEndpoint,
    GaveUp,
    Incoming,
    PeerSilent,
    Received,
    Replied,
    Stalled,
    TransportConfig,
)
from tests.runtime.harness import FakeClock

pytestmark = pytest.mark.timeout(60)

BEAT = 1.0
CFG = TransportConfig(
    retry_interval_s=0.5, deadline_s=5.0, heartbeat_interval_s=BEAT, missed_heartbeats=3
)
WINDOW = BEAT * 3


@pytest.fixture
def pair() -> Iterator[tuple[FakeClock, ControllerEndpoint, AgentEndpoint]]:
    clock = FakeClock()
    ctl = ControllerEndpoint(config=CFG, clock=clock, epoch=1)
    agent = AgentEndpoint(connect=ctl.endpoint, host_id="h0", config=CFG, clock=clock, epoch=1)
    try:
        yield clock, ctl, agent
    finally:
        agent.close()
        ctl.close()


def drain(endpoint: ControllerEndpoint | AgentEndpoint, rounds: int = 20) -> list[Incoming]:
    """What a few short polls bring (the frames of a real socket take a moment)."""
    out: list[Incoming] = []
    for _ in range(rounds):
        out += endpoint.poll(0.005)
    return out


def listen(
    clock: FakeClock, ctl: ControllerEndpoint, agent: AgentEndpoint | None, seconds: float
) -> list[Incoming]:
    """`seconds` of the controller listening (polled every tenth of a heartbeat), the agent
    polled too unless it is None (dead: it sends nothing)."""
    out: list[Incoming] = []
    for _ in range(round(seconds / (BEAT / 10))):
        clock.advance(BEAT / 10)
        if agent is not None:
            drain(agent, 2)
        out += drain(ctl, 2)
    return out


def joined(clock: FakeClock, ctl: ControllerEndpoint, agent: AgentEndpoint) -> None:
    agent.send_event("hello", {})
    listen(clock, ctl, agent, 1.0)
    assert "h0" in ctl.peers()


def of(items: list[Incoming], kind: type) -> list[Incoming]:
    return [i for i in items if isinstance(i, kind)]


def test_a_stall_is_reported_and_counts_toward_no_peer_silence(
    pair: tuple[FakeClock, ControllerEndpoint, AgentEndpoint],
) -> None:
    clock, ctl, agent = pair
    joined(clock, ctl, agent)
    clock.advance(20.0)  # the controller stopped: it polls nothing for 20 s
    first = ctl.poll(0.0)
    (stall,) = of(first, Stalled)
    assert isinstance(stall, Stalled)
    assert stall.away_s == pytest.approx(20.0, abs=0.2)
    assert stall.credited_s == pytest.approx(stall.away_s - BEAT / 2)
    assert ctl.stalled_s == pytest.approx(stall.credited_s)
    # a whole silence window to be heard again: the agent's heartbeat comes in it
    later = listen(clock, ctl, agent, WINDOW)
    assert of(first + later, PeerSilent) == []
    assert ctl.peers()["h0"].deaf_s == 0.0  # heard: the credit is spent


def test_without_the_discount_the_same_stall_took_the_agent_for_silent() -> None:
    """The code before: every second of the clock counted (a fresh pair, the option off)."""
    clock = FakeClock()
    old = TransportConfig(
        retry_interval_s=0.5,
        deadline_s=5.0,
        heartbeat_interval_s=BEAT,
        missed_heartbeats=3,
        discount_own_stalls=False,
    )
    ctl = ControllerEndpoint(config=old, clock=clock, epoch=1)
    agent = AgentEndpoint(connect=ctl.endpoint, host_id="h0", config=old, clock=clock)
    try:
        joined(clock, ctl, agent)
        clock.advance(20.0)
        first = ctl.poll(0.0)
        assert of(first, Stalled) == []
        assert [i.peer for i in of(first, PeerSilent)] == ["h0"]  # type: ignore[attr-defined]
    finally:
        agent.close()
        ctl.close()


def test_a_peer_dead_through_the_stall_is_still_found_silent(
    pair: tuple[FakeClock, ControllerEndpoint, AgentEndpoint],
) -> None:
    clock, ctl, agent = pair
    joined(clock, ctl, agent)
    clock.advance(20.0)
    items = ctl.poll(0.0)
    assert of(items, PeerSilent) == []
    items += listen(clock, ctl, None, WINDOW + BEAT)  # the agent sends nothing any more
    (silent,) = of(items, PeerSilent)
    assert silent.silent_for_s >= 20.0  # type: ignore[attr-defined]  # the truth: since heard


def test_a_controller_blocked_every_turn_still_finds_a_dead_peer(
    pair: tuple[FakeClock, ControllerEndpoint, AgentEndpoint],
) -> None:
    """Its loop blocked 5 s every turn (longer than the silence window), then polled once: a
    dead agent is reported within a few turns, not never (only the first long stall after a
    peer was heard gives it a whole window; the rest are credited by what they exceed)."""
    clock, ctl, agent = pair
    joined(clock, ctl, agent)
    items: list[Incoming] = []
    turns = 0
    while not of(items, PeerSilent) and turns < 12:
        clock.advance(5.0)
        items += ctl.poll(0.0)
        turns += 1
    assert of(items, PeerSilent), "the dead agent was never reported"
    assert turns <= 9, turns  # listening accrues half a heartbeat a turn: 6 turns + the first


def test_an_answer_waiting_through_the_stall_is_not_given_up(
    pair: tuple[FakeClock, ControllerEndpoint, AgentEndpoint],
) -> None:
    clock, ctl, agent = pair
    joined(clock, ctl, agent)
    msg = ctl.send_command("h0", "stop", {}, deadline_s=5.0)
    (cmd,) = of(drain(agent), Received)
    agent.reply(cmd, ok=True, result={"done": 1})  # type: ignore[arg-type]
    clock.advance(20.0)  # stopped past the command's deadline; the reply waits in the socket
    items = drain(ctl)
    assert of(items, GaveUp) == []
    (replied,) = of(items, Replied)
    assert replied.msg_id == msg  # type: ignore[attr-defined]
