"""A step of the wall clock (NTP setting it, an operator's `date -s`, a VM resumed) moves no
deadline of the controller and silences no agent: the controller reads the wall clock once and
times everything by the monotonic clock from there (`shell.loop.steady_wall_clock`).

A real controller and the real agent endpoint of h1 over real sockets (the rig of
`test_sender_checks`), with e0 installing on h1. The machine's own clock cannot be set by a
test (it is every process's), so the controller is given a wall clock the test steps: the
system clock plus an offset, as `time.time` reads after the clock was set.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ehp_fsm.runtime.endpoint import CONTROLLER_NAME
from tests.runtime_system.test_sender_checks import Rig, installing_rig

pytestmark = pytest.mark.timeout(60)
HOUR = 3600.0


class SetClock:
    """The wall clock as `time.time` reads it, `offset` seconds after it was set."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[tuple[Rig, SetClock]]:
    wall = SetClock()
    with installing_rig(tmp_path, clock=wall) as r:
        yield r, wall


def pump_for(r: Rig, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        r.pump(1)


def test_the_wall_clock_set_an_hour_ahead_fires_no_deadline_and_silences_no_agent(
    rig: tuple[Rig, SetClock],
) -> None:
    r, wall = rig
    before = r.ctl.now()
    wall.offset = HOUR  # e0's install deadline is 30 s; the silence window a second
    pump_for(r, 0.6)  # a deadline past fires at the next tick, a silent agent at the next poll
    assert r.state("rollout_engine", "e0") == "installing"
    assert r.state("gpu", "h1:g0") != "quarantined"
    assert 0.6 <= r.ctl.now() - before < 60.0


def test_the_wall_clock_set_an_hour_back_holds_back_no_heartbeat(
    rig: tuple[Rig, SetClock],
) -> None:
    r, wall = rig
    before = r.ctl.now()
    pump_for(r, 0.2)
    wall.offset = -HOUR
    heard = r.agent.peers()[CONTROLLER_NAME].last_seen
    pump_for(r, 0.8)  # the controller heartbeats every 0.25 s: the agent hears it
    assert r.agent.peers()[CONTROLLER_NAME].last_seen - heard >= 0.4
    assert r.ctl.now() - before >= 1.0  # times go on forward
