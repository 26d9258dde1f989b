"""The request lifecycle against real embedded engines over HTTP: a run of training steps (each
one driven through the training_step machine, which alone claims and consumes its G groups) with
publications, a borrow (drain with /pause_generation retract, stop) and a return (a new engine
on the freed GPU installs the newest revision before it serves), and an engine killed with
SIGKILL while it holds groups. Every group is consumed exactly once, every consumed group is
fresh, every engine still up reports the final revision through /model_info, and each group's
journey is in the transition log.

The engines run with a 30 ms per-pass decode throttle (a stand-in for a slow device — the only
faked edge) so that groups are really in flight when an engine is drained or killed."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from ehp_fsm.core.transition import Rejected
from ehp_fsm.replay import replay
from ehp_fsm.training.task import exact_rate, mean_reward

from .fleet import Fleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture
def fleet(tmp_path: Path, tiny_model: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path, base=tiny_model, group_size=4, decode_delay_ms=30.0)
    try:
        yield f
    finally:
        f.shutdown()


def _until_inflight(fleet: Fleet, eid: str, timeout_s: float = 20.0) -> list[str]:
    """The groups in flight on `eid` once one of them was dispatched this very round (so at
    least one is surely still being generated; older ones may be about to answer)."""
    before = set(fleet.disp.inflight(eid))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fleet.disp.fill(8)
        fleet.pump(0.01)
        held = fleet.disp.inflight(eid)
        if set(held) - before:
            return held
        before = set(held)
    raise AssertionError(f"no group newly dispatched to {eid}")


def _step(fleet: Fleet, n: int, consumed: list[str]) -> None:
    G = fleet.groups_per_step
    fleet.disp.fill(3 * G)
    ids = fleet.wait_completed(G, timeout_s=40)
    assert len(ids) == G, f"step {n}: only {len(ids)} groups completed"
    groups = fleet.disp.results(ids)
    floor = fleet.loop.world.globals["revision"] - fleet.loop.world.config["max_staleness"]
    assert all(g.revision >= floor for g in groups)  # fresh enough to train on
    assert exact_rate([g.samples for g in groups]) <= 1.0
    assert 0.0 <= mean_reward([g.samples for g in groups]) <= 1.0
    # nobody claims a group outside a training step's `partition`
    direct = fleet.fire("request", ids[0], "claim", step=f"step-{n}")
    assert isinstance(direct, Rejected) and "does not exist" in direct.reason, direct
    outs, rev = fleet.train_step(n, ids)
    assert all(o.accepted for o in outs) and rev == n + 1
    stepped = outs[-2]
    cascaded = [r.instance for r in stepped.records if r.event == "consume" and r.accepted]
    assert sorted(cascaded) == sorted(ids)  # consumed by the optimizer step, as one outcome
    for gid in ids:
        inst = fleet.loop.world.get("request", gid)
        assert inst is not None and inst.state == "consumed"
    consumed += ids


def test_borrow_return_and_sigkill_requeue_every_group_exactly_once(fleet: Fleet) -> None:
    t0 = time.monotonic()
    fleet.start_processes(["e0", "e1", "e2"])
    fleet.publish()
    fleet.launch("e0", "h1:g0")
    fleet.launch("e1", "h1:g1")
    assert fleet.settle(30)
    consumed: list[str] = []
    _step(fleet, 1, consumed)

    # borrow: e1 is drained while it holds groups; they are requeued and served elsewhere
    assert fleet.settle(30)  # (the machine refuses a drain while an engine is updating)
    held = _until_inflight(fleet, "e1")
    fleet.borrow("e1")
    assert fleet.state("e1") == "stopped"
    for gid in held:  # retracted and back in the queue, or answered before the drain reached e1
        inst = fleet.loop.world.get("request", gid)
        assert inst is not None and inst.state in ("queued", "dispatched", "completed")
        assert inst.state == "completed" or inst.get("engine") != "e1"
    _step(fleet, 2, consumed)
    _step(fleet, 3, consumed)

    # return: a new engine on the freed GPU installs the newest revision before serving
    gpu = fleet.loop.world.get("gpu", "h1:g1")
    assert gpu is not None and gpu.state == "free"
    fleet.launch("e2", "h1:g1")
    assert fleet.settle(30)
    assert fleet.state("e2") == "serving"
    _step(fleet, 4, consumed)

    # e0 dies with SIGKILL mid-request: the dispatcher reports it; its groups are requeued
    held = _until_inflight(fleet, "e0")
    fleet.kill("e0")
    deadline = time.monotonic() + 20
    while fleet.state("e0") != "failed" and time.monotonic() < deadline:
        fleet.pump()
    assert fleet.state("e0") == "failed"
    assert fleet.disp.inflight("e0") == []
    _step(fleet, 5, consumed)
    _step(fleet, 6, consumed)
    assert fleet.settle(30)
    fleet.pump()  # the dispatcher forgets consumed groups on its next round

    G = fleet.groups_per_step
    final = fleet.loop.world.globals["revision"]
    assert final == fleet.next_rev - 1 == 7
    assert fleet.state("e2") == "serving"
    assert fleet.clients["e2"].model_info().weight_version == str(final)

    # exactly once: no duplicates, every consumed group is in `consumed`, none lost
    assert len(consumed) == len(set(consumed)) == 6 * G
    # of the world the log gives back whole (the orchestrator's own forgets consumed groups and
    # done steps: it answers their state only)
    world = replay(fleet.log_path).world
    reqs = world.of("request")
    assert sorted(r.id for r in reqs.values() if r.state == "consumed") == sorted(consumed)
    assert all(fleet.loop.world.get("request", g).state == "consumed" for g in consumed)
    assert fleet.disp.stats.engine_failures == 1
    assert fleet.disp.stats.consumed == len(consumed)
    steps = world.of("training_step")
    assert sorted(s.state for s in steps.values()) == ["done"] * 6
    assert sorted(g for s in steps.values() for g in s.get("groups")) == sorted(consumed)
    assert fleet.disp.stats.enqueued == len(reqs)

    # the journey of every group is in the transition log, consume exactly once each
    lines = [json.loads(line) for line in fleet.log_path.read_text().splitlines()]
    flat = [r for r in lines if "machine" in r]  # one record per line after the header
    consumes = Counter(
        r["instance"] for r in flat if r.get("event") == "consume" and r.get("accepted")
    )
    assert set(consumes) == set(consumed) and set(consumes.values()) == {1}
    # … each claim a cascade of its step's `partition`, each consume of its step's `stepped`
    by_seq = {r["seq"]: r for r in flat}
    for event, cause in (("claim", "partition"), ("consume", "stepped")):
        for r in flat:
            if r.get("machine") == "request" and r.get("event") == event and r.get("accepted"):
                parent = by_seq[r["cause"]]
                assert (parent["machine"], parent["event"]) == ("training_step", cause), r
                assert parent["instance"] == r["payload"]["step"]
    for event in ("claim", "consume"):  # the direct attempts of `_step` and `train_step`
        refused = [r for r in flat if r.get("event") == event and not r.get("accepted")]
        assert len(refused) == 6, (event, refused)
    requeued = {
        r["instance"]
        for r in flat
        if r.get("machine") == "request" and r.get("event") == "abort" and r.get("accepted")
    }
    answered = {  # an answer already on its way when SIGKILL landed still completes its group
        r["instance"]
        for r in flat
        if r.get("machine") == "request"
        and r.get("event") == "complete"
        and r.get("accepted")
        and r["payload"]["engine"] == "e0"
    }
    # the killed engine's groups went back to the queue (the ones still being generated)
    assert set(held) <= requeued | answered and set(held) & requeued
    assert requeued & set(consumed)  # and some of them were trained on after regeneration
    drains = [r for r in flat if r.get("event") == "drain" and r.get("accepted")]
    assert any(
        c["kind"] == "pause_generation" and c["args"]["mode"] == "retract"
        for r in drains
        for c in r["effects"]
    )
    assert len(fleet.store.revisions()) <= 3  # retired revisions were deleted from disk

    # The engines' pace the planner reads (`Dispatcher.pace`): busy GPU-seconds through the
    # drain, the kill and the requeues. At most two TP1 engines served at once, so no more
    # than twice the test's time; every group took at least one 30 ms decode pass, shared by at
    # most `max_inflight_per_engine` groups of one engine.
    busy, made = fleet.disp.pace()
    wall = time.monotonic() - t0
    assert made >= 6 * G, made
    cap = fleet.disp.config.max_inflight_per_engine
    assert 0.03 * made / cap <= busy <= 2 * wall, (busy, made, wall)
