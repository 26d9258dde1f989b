"""A controller frozen (SIGSTOP) past its agents' silence window, then resumed: every agent
hears it again within seconds, an agent with nothing to send but heartbeats included.

The focused form of `tests/run/test_controller_frozen.py` (a whole `ehp-fsm run`, 60 s): a real
`ControllerEndpoint` in a child process (`tests.runtime.frozen_controller`), three real
`AgentEndpoint`s here, a real SIGSTOP. While the controller is frozen libzmq drops each agent's
connection (ZMTP heartbeat time-out) and the agent's next connection waits in the frozen
process's listen queue. At the resume that connection completes its handshake beside the old
connection's teardown, so the controller's ROUTER (no handover) parks it: the agent must open
another. With the controller's loop blocked 2.5 silence windows per turn (a long training step
after the resume), an agent that replaced its connection once per window closed every
connection the controller had attached before the controller could send on it: it never heard
the controller again while the controller kept hearing it (the closed connections' frames) —
the Core host's agent in a loaded CI run of the whole-run test.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator

import pytest

from ehp_fsm.runtime import (
    Acked,
    AgentEndpoint,
    Incoming,
    LinkChanged,
    PeerJoined,
    PeerReturned,
)
from tests.runtime.frozen_controller import config

HEARTBEAT_S = 0.2  # silence window 0.6 s; ZMTP time-out 0.8 s
FROZEN_S = 1.5  # past the ZMTP time-out: every agent's connection is dropped
HOSTS = ("h0", "h1", "h2")  # h0 sends nothing but heartbeats (the Core host runs no engine)


@pytest.fixture
def controller(request: pytest.FixtureRequest) -> Iterator[tuple[subprocess.Popen[str], str]]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.runtime.frozen_controller",
            str(HEARTBEAT_S),
            str(request.param),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    # Keep reading what it prints: a full pipe would block it (a freeze of its own).
    reader = threading.Thread(target=proc.stdout.read, daemon=True)
    try:
        endpoint = json.loads(proc.stdout.readline())["endpoint"]
        reader.start()
        yield proc, endpoint
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()
        if reader.is_alive():
            reader.join(timeout=5)
        proc.stdout.close()


class Agents:
    """The agents' side, polled in turn; every delivery kept with the time it came."""

    def __init__(self, endpoint: str) -> None:
        self.endpoints = [
            AgentEndpoint(connect=endpoint, host_id=h, config=config(HEARTBEAT_S), epoch=2)
            for h in HOSTS
        ]
        self.log: dict[str, list[tuple[float, Incoming]]] = defaultdict(list)

    def turn(self) -> None:
        for agent in self.endpoints:
            for item in agent.poll(0.005):
                self.log[agent.name].append((time.monotonic(), item))

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.turn()

    def first(self, host: str, kind: type, after: float) -> float | None:
        return next((t for t, i in self.log[host] if isinstance(i, kind) and t > after), None)

    def close(self) -> None:
        for agent in self.endpoints:
            agent.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "controller", [0.0, 1.5], ids=["controller_polling", "controller_blocked"], indirect=True
)
def test_every_agent_hears_a_resumed_controller_again(
    controller: tuple[subprocess.Popen[str], str],
) -> None:
    proc, endpoint = controller
    agents = Agents(endpoint)
    try:
        deadline = time.monotonic() + 10
        while not all(agents.first(h, PeerJoined, 0) for h in HOSTS):
            assert time.monotonic() < deadline, "the agents never heard the controller"
            agents.turn()
        proc.send_signal(signal.SIGSTOP)
        agents.run_for(FROZEN_S)
        deadline = time.monotonic() + 10  # the freeze drops them (late on a loaded machine)
        while not all(a.connection_dropped for a in agents.endpoints):
            assert time.monotonic() < deadline, "the freeze dropped no connection"
            agents.turn()
        proc.send_signal(signal.SIGCONT)
        resumed = time.monotonic()
        deadline = resumed + 15
        back: dict[str, float] = {}
        acked: dict[str, float] = {}
        sent: dict[str, str] = {}
        while len(acked) < len(HOSTS):
            assert time.monotonic() < deadline, (
                f"heard again (s after the resume): {back}; event acked: {acked}; "
                f"reconnects: {[a.stats['reconnects'] for a in agents.endpoints]}"
            )
            agents.turn()
            for agent in agents.endpoints:
                host = agent.name
                if host not in back and (t := agents.first(host, PeerReturned, resumed)):
                    back[host] = round(t - resumed, 2)
                    # Both ways: the controller acknowledges a message sent after it.
                    sent[host] = agent.send_event("probe", {})
                if host in sent and host not in acked:
                    for t, item in agents.log[host]:
                        if isinstance(item, Acked) and item.msg_id == sent[host]:
                            acked[host] = round(t - resumed, 2)
        whys = {
            a.name: [
                i.why
                for t, i in agents.log[a.name]
                if isinstance(i, LinkChanged) and i.what == "reconnected" and t > resumed
            ]
            for a in agents.endpoints
        }
        print(f"heard again after the resume (s): {back}; acked: {acked}; replaced: {whys}")
    finally:
        agents.close()
