"""A controller endpoint in a process of its own, for tests that freeze it (SIGSTOP).

Run as `python -m tests.runtime.frozen_controller HEARTBEAT_S BLOCKED_S`. It binds a real
`ControllerEndpoint` on 127.0.0.1, prints `{"endpoint": ...}`, then loops: a turn of the loop
is blocked for BLOCKED_S (as `ehp-fsm run`'s loop is by a training step), then the endpoint is
polled for up to 50 ms. Every liveness change it sees is printed as one JSON line, so a test
can tell whether the controller heard its agents.
"""

from __future__ import annotations

import json
import sys
import time

from ehp_fsm.runtime import (
    ControllerEndpoint,
    PeerJoined,
    PeerRestarted,
    PeerReturned,
    PeerSilent,
    Received,
    TransportConfig,
)


def config(heartbeat_s: float) -> TransportConfig:
    """The transport settings of both sides of the frozen-controller tests."""
    return TransportConfig(
        heartbeat_interval_s=heartbeat_s,
        missed_heartbeats=3,
        retry_interval_s=heartbeat_s / 2,
        deadline_s=60.0,
    )


def main(heartbeat_s: float, blocked_s: float) -> None:
    ctl = ControllerEndpoint(config=config(heartbeat_s), epoch=1)
    print(json.dumps({"endpoint": ctl.endpoint}), flush=True)
    while True:
        time.sleep(blocked_s)
        for item in ctl.poll(0.05):
            if isinstance(item, PeerJoined | PeerReturned | PeerRestarted | PeerSilent):
                line = {"what": type(item).__name__, "peer": item.peer, "t": time.monotonic()}
                print(json.dumps(line), flush=True)
            elif isinstance(item, Received):
                line = {"what": "Received", "peer": item.peer, "t": time.monotonic()}
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]), float(sys.argv[2]))
