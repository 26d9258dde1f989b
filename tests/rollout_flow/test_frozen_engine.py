"""Engines frozen (SIGSTOP, never continued) against real embedded engines over HTTP.

A frozen engine is not a dead one: its process is there and its port takes connections, but
nothing answers, so each call to it waits out its client timeout (an install the engine
machine's install deadline, 60 s; a group's `/generate` `[deadlines.run] generate`, 60 s).

* Its install of a new revision hangs and it stays `updating`. The run's planner waited for
  `not Publisher.busy()` — every engine done installing — before each decision, so every step
  waited for the frozen engine's install deadline while the other engines served.
  `Publisher.settled` waits for an install only while it is no slower than the run's installs
  so far (`settle_s`), and names the engine left behind (`lagging`).
* Its `/generate` calls hold their threads for the generate timeout. One pool of 8 threads
  served every engine's calls (4 groups in flight per engine), so two frozen engines of three
  held every thread and the serving engine's groups waited a minute for one; each engine now
  has threads of its own, as many as groups it may hold.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .fleet import Fleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture
def fleet(tmp_path: Path, tiny_model: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path, base=tiny_model, group_size=4, decode_delay_ms=100.0)
    frozen: list[int] = []
    f.frozen = frozen  # type: ignore[attr-defined]
    try:
        yield f
    finally:
        for pid in frozen:  # continued, so the fleet's SIGTERM stops them at once
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        f.shutdown()


def _freeze(fleet: Fleet, eid: str) -> None:
    pid = fleet.handles[eid].pid
    os.kill(pid, signal.SIGSTOP)
    fleet.frozen.append(pid)  # type: ignore[attr-defined]


def test_a_frozen_engine_s_install_is_not_waited_for_past_the_settle_bound(fleet: Fleet) -> None:
    fleet.start_processes(["e0", "e1"])
    fleet.publish()
    fleet.launch("e0", "h1:g0")
    fleet.launch("e1", "h1:g1")
    assert fleet.settle(30)
    assert fleet.pub.settled() and fleet.pub.lagging() == []
    _freeze(fleet, "e1")
    fleet.publish(wait=False)  # e1's install of it gets no answer
    # a few times the slowest install so far (here the engines' first: they start empty and
    # load the model), well below the install deadline the old wait waited out
    bound = fleet.pub.settle_s()
    assert bound < fleet.pub.config.install_timeout_s, bound
    t0 = time.monotonic()
    while not fleet.pub.settled() and time.monotonic() - t0 < bound + 10.0:
        fleet.pump(0.02)
    waited = time.monotonic() - t0
    assert fleet.pub.settled(), "the world never settled without the frozen engine"
    assert waited < bound + 5.0, waited
    assert fleet.pub.lagging() == ["e1"]
    assert fleet.pub.busy()  # the old wait: until the frozen engine's install deadline
    assert fleet.state("e0") == "serving" and fleet.state("e1") == "updating"
    # and the groups go on through the engine that serves
    fleet.disp.fill(2 * fleet.groups_per_step)
    ids = fleet.wait_completed(fleet.groups_per_step, timeout_s=30)
    assert len(ids) == fleet.groups_per_step
    assert {g.engine for g in fleet.disp.results(ids)} == {"e0"}


def test_frozen_engines_hold_only_their_own_generate_threads(fleet: Fleet) -> None:
    fleet.start_processes(["e0", "e1", "e2"])
    fleet.publish()
    for eid, gpu in (("e0", "h1:g0"), ("e1", "h1:g1"), ("e2", "h2:g0")):
        fleet.launch(eid, gpu)
    assert fleet.settle(30)
    cap = fleet.disp.config.max_inflight_per_engine
    fleet.disp.fill(3 * cap)
    fleet.pump(0.0)  # every engine takes `cap` groups; their calls start
    assert all(len(fleet.disp.inflight(e)) == cap for e in ("e0", "e1", "e2"))
    _freeze(fleet, "e1")
    _freeze(fleet, "e2")
    # e0 alone serves from now on: 8 groups more than the frozen engines hold
    want = 2 * cap
    t0 = time.monotonic()
    while time.monotonic() - t0 < 40.0:
        fleet.disp.fill(2 * cap + want + cap)
        fleet.pump(0.02)
        done = fleet.disp.completed_groups()
        if len(done) >= want:
            break
    done = fleet.disp.completed_groups()
    assert len(done) >= want, (
        f"{len(done)} groups completed in {time.monotonic() - t0:.1f} s: the serving engine's "
        "calls waited for threads the frozen engines' calls held"
    )
    assert {g.engine for g in fleet.disp.results(done)} == {"e0"}
    # the frozen engines still hold their groups (no answer yet, none lost)
    assert len(fleet.disp.inflight("e1")) == cap and len(fleet.disp.inflight("e2")) == cap
