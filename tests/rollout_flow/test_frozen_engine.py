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
* While it stays `serving` (no new revision to install) nothing judged it: each of its calls
  timed out, its groups were requeued after a 1 s back-off and went straight back to it, each
  time for another generate timeout. A `/generate` that gets no answer at all now takes the
  engine out of routing until a short `/health` probe answers; a probe that gets no answer
  either fails the engine (`fail`, logged), which requeues what it still holds.
* At the run's end the weight version of every engine still up is asked for the receipt; a
  frozen one held the end for a whole control-call timeout (10 s). The query is bounded short.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ehp_fsm.rollout import SGLangClient
from ehp_fsm.run.ending import engine_revisions

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


def test_a_frozen_serving_engine_is_failed_once_its_health_probe_gets_no_answer(
    fleet: Fleet,
) -> None:
    generate_s = 4.0  # the run's is `[deadlines.run] generate` (60 s)
    fleet.disp.config = dataclasses.replace(fleet.disp.config, generate_timeout_s=generate_s)
    probe_s = fleet.disp.config.probe_timeout_s
    fleet.start_processes(["e0", "e1"])
    fleet.publish()
    fleet.launch("e0", "h1:g0")
    fleet.launch("e1", "h1:g1")
    assert fleet.settle(30)
    cap = fleet.disp.config.max_inflight_per_engine
    t0 = time.monotonic()
    while len(fleet.disp.inflight("e1")) < cap and time.monotonic() - t0 < 30:
        fleet.disp.fill(len(fleet.disp.completed_groups()) + 2 * cap)  # (answered ones count)
        fleet.pump(0.0)
    assert len(fleet.disp.inflight("e1")) == cap
    _freeze(fleet, "e1")  # no revision is published after this: e1 stays `serving`
    frozen_at = time.monotonic()
    while fleet.state("e1") == "serving" and time.monotonic() - frozen_at < 2 * generate_s + 20:
        fleet.disp.fill(2 * cap)
        fleet.pump(0.02)
    assert fleet.state("e1") == "failed", (
        f"e1 still {fleet.state('e1')} {time.monotonic() - frozen_at:.1f} s after it froze: "
        "its timed-out calls were requeued and sent back to it"
    )
    inst = fleet.loop.world.get("rollout_engine", "e1")
    assert inst is not None and "/health" in str(inst.get("reason")), inst
    assert fleet.disp.stats.engine_failures == 1 and fleet.disp.stats.probes == 1
    # e0 serves on: the groups e1 held complete there
    to_e1 = {
        r["instance"]
        for r in _accepted(fleet, "request")
        if r["event"] == "dispatch" and r["payload"]["engine"] == "e1"
    }
    t1 = time.monotonic()
    while time.monotonic() - t1 < 30:
        fleet.disp.fill(2 * cap)
        fleet.pump(0.02)
        if all(_state(fleet, g) in ("completed", "claimed", "consumed") for g in to_e1):
            break
    assert all(_state(fleet, g) == "completed" for g in to_e1), to_e1
    assert fleet.disp.inflight("e1") == []
    # (the loop's clock is `time.monotonic`; the fleet's stop of the failed engine, a grace
    # before SIGKILL on the loop's thread, comes after the `fail`)
    failed_at = next(
        r["time"]
        for r in _accepted(fleet, "rollout_engine")
        if (r["instance"], r["event"]) == ("e1", "fail")
    )
    assert failed_at - frozen_at < generate_s + probe_s + 3.0, failed_at - frozen_at
    requests = _accepted(fleet, "request")
    timed_out = [
        r["time"]
        for r in requests
        if r["event"] == "abort" and "no answer within" in r["payload"]["reason"]
    ]
    assert timed_out, "no /generate to e1 timed out"
    # from its first time-out on, no group was sent to the frozen engine
    late = [
        r["instance"]
        for r in requests
        if r["event"] == "dispatch" and r["payload"]["engine"] == "e1" and r["time"] >= timed_out[0]
    ]
    assert late == [], late
    # each dispatch to e1 ended once: answered before the freeze, or requeued exactly once
    # and then sent to e0
    for gid in to_e1:
        journey = [(r["event"], r["payload"].get("engine")) for r in requests]
        journey = [j for j, r in zip(journey, requests, strict=True) if r["instance"] == gid]
        for k, step in enumerate(journey):
            if step == ("dispatch", "e1"):
                after = journey[k + 1 : k + 3]
                assert after[:1] == [("complete", "e1")] or after == [
                    ("abort", None),
                    ("dispatch", "e0"),
                ], (gid, journey)


def _accepted(fleet: Fleet, machine: str) -> list[dict[str, Any]]:
    """The accepted transitions of `machine`'s instances in the log, in order."""
    rows = [json.loads(x) for x in fleet.log_path.read_text().splitlines()]
    return [r for r in rows if r.get("machine") == machine and r.get("accepted")]


def _state(fleet: Fleet, gid: str) -> str:
    inst = fleet.loop.world.get("request", gid)
    assert inst is not None
    return str(inst.state)


def test_the_run_s_end_asks_a_frozen_engine_for_its_weight_version_only_briefly(
    fleet: Fleet,
) -> None:
    fleet.start_processes(["e0", "e1"])
    fleet.publish()
    fleet.launch("e0", "h1:g0")
    fleet.launch("e1", "h1:g1")
    assert fleet.settle(30)
    _freeze(fleet, "e1")  # still `serving` as far as the world knows
    # the run's clients: 10 s for a control call (`startup.rollout_shell`)
    clients = {eid: SGLangClient(h.url, timeout_s=10.0) for eid, h in fleet.handles.items()}
    try:
        t0 = time.monotonic()
        answers = engine_revisions(clients, fleet.loop.world)
        took = time.monotonic() - t0
    finally:
        for c in clients.values():
            c.close()
    assert answers["e0"] == "1", answers
    assert str(answers["e1"]).startswith("unreachable"), answers
    assert took < 6.0, f"the weight-version query at the run's end took {took:.1f} s"
