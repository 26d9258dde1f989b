"""Publication through the machines against real embedded engine processes over HTTP: a failed
install keeps the engine out of routing until a reload succeeds; an engine that dies during a
publication and is restarted installs the newest revision; an engine launched after revisions
1..3 serves only after installing 3 (install-before-serve); an engine started from the current
revision is not loaded twice."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ehp_fsm.rollout.dispatch import CompletedGroup
from tests.rollout.hf import revision_state

from .fleet import Fleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


@pytest.fixture
def fleet(tmp_path: Path, tiny_model: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path, base=tiny_model)
    try:
        yield f
    finally:
        f.shutdown()


def _refused_dispatch(fleet: Fleet, eid: str, gid: str) -> str:
    fleet.fire("request", gid, "enqueue", prompt="1+1=")
    out = fleet.fire("request", gid, "dispatch", engine=eid)
    assert not out.accepted, f"{eid} took a request while {fleet.state(eid)}"
    return str(out.reason)  # type: ignore[union-attr]


def _until_served_by(fleet: Fleet, eid: str, *, timeout_s: float) -> list[CompletedGroup]:
    """Pump the dispatcher until `eid` has completed a group (or `timeout_s` passes); every
    group completed by then."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = fleet.disp.results(fleet.disp.completed_groups())
        if any(g.engine == eid for g in done) or time.monotonic() >= deadline:
            return done
        fleet.disp.pump(timeout_s=0.05)


def test_failed_install_keeps_engine_out_of_routing_until_a_reload_succeeds(
    fleet: Fleet,
) -> None:
    fleet.start_processes(["e0", "e1"])
    fleet.publish()  # revision 1, before any engine: each installs it on `healthy`
    fleet.launch("e0", "h1:g0")
    fleet.launch("e1", "h1:g1")
    assert fleet.settle(30)
    assert [fleet.state(e) for e in ("e0", "e1")] == ["serving", "serving"]

    out = fleet.pub.save(
        revision=2, step=2, state_dict=revision_state(fleet.base, 2), base=fleet.base
    )
    assert out.accepted
    weights = fleet.store.path(2) / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[: len(good) // 2])  # cut short on disk after it was hashed
    assert fleet.pub.publish(2).accepted
    deadline = time.monotonic() + 20
    while fleet.pub.stats.install_failures < 4 and time.monotonic() < deadline:
        fleet.pump()
    assert fleet.pub.stats.install_failures >= 4  # retried, and failing every time
    for eid in ("e0", "e1"):
        assert fleet.state(eid) == "installing"
        assert "only serving engines" in _refused_dispatch(fleet, eid, f"x-{eid}")
        # the engine itself serves on its installed weights, as SGLang does after a failed
        # load; the machine keeps it out of routing until an install succeeds
        info = fleet.clients[eid].model_info()
        assert info.status == "serving" and info.weight_version == "1"
    fleet.disp.fill(2)
    fleet.pump()
    assert fleet.disp.inflight() == []  # the dispatcher routes nowhere

    weights.write_bytes(good)  # the revision is repaired: the next retry succeeds
    assert fleet.settle(30)
    for eid in ("e0", "e1"):
        assert fleet.state(eid) == "serving"
        assert fleet.clients[eid].model_info().weight_version == "2"
    ids = fleet.disp.wait_completed(2, timeout_s=30)
    assert len(ids) == 2
    assert {g.revision for g in fleet.disp.results(ids)} == {2}


def test_restart_during_publication_then_install_before_serve_on_return(fleet: Fleet) -> None:
    fleet.start_processes(["e0", "e1", "late", "e1b"])
    fleet.publish()
    fleet.launch("e0", "h1:g0")
    fleet.launch("e1", "h1:g1")
    assert fleet.settle(30)

    fleet.kill("e1")  # dies while revision 2 is being published
    fleet.publish(wait=False)
    assert fleet.settle(30)
    assert fleet.state("e1") == "failed"  # install to a dead process → fail, GPU released
    gpu = fleet.loop.world.get("gpu", "h1:g1")
    assert gpu is not None and gpu.state == "free"
    fleet.launch("e1b", "h1:g1")  # restarted on the same GPU
    assert fleet.settle(30)
    assert fleet.state("e1b") == "serving"
    assert fleet.clients["e1b"].model_info().weight_version == "2"

    fleet.pub.retire_unreferenced()  # e0 and e1b hold 2: nothing to retire but 1
    fleet.publish()  # revision 3, while `late` is not launched
    assert fleet.next_rev - 1 == 3
    fleet.launch("late", "h2:g0", healthy=False)
    assert "only serving engines" in _refused_dispatch(fleet, "late", "x0")
    assert fleet.clients["late"].model_info().weight_version is None  # no weights at all
    fleet.healthy("late")
    assert fleet.state("late") in ("installing", "serving")
    assert fleet.settle(30)
    assert fleet.state("late") == "serving"
    for eid in ("e0", "e1b", "late"):
        assert fleet.clients[eid].model_info().weight_version == "3"
    # the first request `late` ever serves is tagged with revision 3, as is every other group
    # completed by then. (Not all six are waited for: one of them, at these weights, samples a
    # token outside the task's vocabulary and is requeued as unscorable, then redrawn.)
    fleet.disp.fill(6)
    completed = _until_served_by(fleet, "late", timeout_s=30)
    assert "late" in {g.engine for g in completed}, completed
    assert {g.revision for g in completed} == {3}, completed

    # Old revisions no engine holds are retired once; a retire the machine would refuse (an
    # engine still holds the revision) is not attempted, so the log carries no refusals of it.
    fleet.pub.retire_unreferenced()
    assert fleet.pub.retire_unreferenced() == []
    # (by id: the world forgets a retired revision, and answers its state only)
    states = {
        r: getattr(fleet.loop.world.get("revision", r), "state", None) for r in ["r1", "r2", "r3"]
    }
    assert states["r1"] == states["r2"] == "retired" and states["r3"] == "published", states
    records = [json.loads(x) for x in fleet.log_path.read_text().splitlines()[1:]]
    retires = [r for r in records if r.get("event") == "retire"]
    assert retires and all(r["accepted"] for r in retires), retires


def test_an_engine_started_from_the_current_revision_is_not_loaded_twice(fleet: Fleet) -> None:
    """An agent starts an engine from the newest revision (`--model-path`, `--weight-version`):
    its install-before-serve finds it serving that revision and loads nothing; the next
    revision is installed as usual."""
    from ehp_fsm.rollout import SGLangClient, launch_engine

    rev = fleet.publish()  # revision 1, before any engine
    h = launch_engine(model_path=fleet.store.path(rev), weight_version=str(rev), deadline_s=90)
    fleet.handles["e0"] = h
    fleet.clients["e0"] = SGLangClient(h.url, timeout_s=5.0, generate_timeout_s=60.0)
    fleet.launch("e0", "h1:g0")
    assert fleet.settle(30)
    assert fleet.state("e0") == "serving"
    assert (fleet.pub.stats.installs, fleet.pub.stats.installs_skipped) == (1, 1)
    fleet.publish()  # revision 2: a real install
    assert fleet.state("e0") == "serving"
    assert (fleet.pub.stats.installs, fleet.pub.stats.installs_skipped) == (2, 1)
    assert fleet.clients["e0"].weight_version() == "2"
