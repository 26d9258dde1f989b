"""Deadlines put off by the shell's own stalls (`core.timers.Postponed`,
`Loop.postpone_deadlines`).

A deadline bounds a peer's time, not the loop's own. A run stopped (SIGSTOP, a paused VM) past
an armed deadline fired it at the resume before it read the report that came meanwhile: an
engine that installed during a 70 s pause had its 60 s install deadline fail it; a training
step's `computing` deadline gave the step up. The loop now puts every armed deadline off by the
seconds it did not turn (its agent link's endpoint measures them: `Stalled`), and only that very
deadline: one armed afresh later is not.
"""

from __future__ import annotations

from ehp_fsm.core.timers import due_deadlines, next_deadline
from ehp_fsm.shell.loop import Loop
from tests.core.scenario import Scenario


def test_a_postponed_deadline_fires_later_and_carries_the_armed_deadline() -> None:
    s = Scenario()
    s.ok("hybrid_replica", "x0", "request")
    armed = s.world.get("hybrid_replica", "x0").get("deadline")
    put_off = {("hybrid_replica", "x0"): (armed, 20.0)}
    assert next_deadline(s.world, put_off) == armed + 20.0
    assert due_deadlines(s.world, armed + 19.0, put_off) == []
    (ev,) = due_deadlines(s.world, armed + 20.0, put_off)
    assert ev.time == armed + 20.0 and ev.payload == {"deadline": armed}
    assert s.engine.handle(ev).accepted  # `deadline_passed`: later than armed is fine
    # an entry for another deadline (the instance re-armed since) puts nothing off
    s.ok("hybrid_replica", "x1", "request")
    other = s.world.get("hybrid_replica", "x1").get("deadline")
    stale = {("hybrid_replica", "x1"): (other - 5.0, 20.0)}
    assert next_deadline(s.world, stale) == other
    assert [e.instance for e in due_deadlines(s.world, other, stale)] == ["x1"]


def test_the_loop_puts_every_armed_deadline_off_by_its_stall() -> None:
    s = Scenario()
    t = [s.now]
    loop = Loop(s.engine, clock=lambda: t[0])
    s.ok("hybrid_replica", "x0", "request")
    armed = s.world.get("hybrid_replica", "x0").get("deadline")
    t[0] = armed - 1.0
    loop.postpone_deadlines(10.0)  # stopped for 10 s (the link's endpoint said so)
    loop.postpone_deadlines(5.0)  # and again: they add up
    t[0] = armed + 14.0
    loop.tick(0.0)
    assert s.state("hybrid_replica", "x0") == "requested"  # what it waits for may still come
    t[0] = armed + 15.0
    loop.tick(0.0)
    assert s.state("hybrid_replica", "x0") == "failed"
    # a deadline armed after the stall is not put off
    t[0] += 1.0
    s.now = t[0]
    s.ok("hybrid_replica", "x1", "request")
    fresh = s.world.get("hybrid_replica", "x1").get("deadline")
    t[0] = fresh
    loop.tick(0.0)
    assert s.state("hybrid_replica", "x1") == "failed"


def test_a_loop_with_a_stall_allowance_puts_deadlines_off_by_its_own_stall() -> None:
    """`tick` measures the stall itself: the time since its last turn beyond the allowance."""
    s = Scenario()
    t = [s.now]
    loop = Loop(s.engine, clock=lambda: t[0], stall_allowance_s=1.0)
    s.ok("hybrid_replica", "x0", "request")
    armed = s.world.get("hybrid_replica", "x0").get("deadline")
    while t[0] < armed - 2.0:  # turning every half second: nothing put off
        t[0] += 0.5
        loop.tick(0.0)
    assert loop._postponed == {}
    t[0] = armed + 8.0  # no turn for 10 s: 9 of them beyond the allowance
    loop.tick(0.0)
    assert s.state("hybrid_replica", "x0") == "requested"
    for _ in range(15):  # turning now: the deadline passes at armed + 9
        t[0] += 0.1
        loop.tick(0.0)
    assert s.state("hybrid_replica", "x0") == "failed"
    # without an allowance (a virtual clock, a test's fake one) every second counts
    s2 = Scenario()
    t2 = [s2.now]
    plain = Loop(s2.engine, clock=lambda: t2[0])
    s2.ok("hybrid_replica", "x0", "request")
    t2[0] = s2.world.get("hybrid_replica", "x0").get("deadline") + 8.0
    plain.tick(0.0)
    assert s2.state("hybrid_replica", "x0") == "failed"
