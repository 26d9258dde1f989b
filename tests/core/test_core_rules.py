"""Issue 18: rules the core holds without the planner, and paths a mutation review found
untested. Each test fails when its rule is removed from the core (checked by reverting it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ehp_fsm import Event, EventError, Orchestrator, load_plan
from ehp_fsm.core.effects import EFFECTS
from ehp_fsm.core.guards import GUARDS
from ehp_fsm.core.invariants import check_invariants
from ehp_fsm.core.timers import due_deadlines, next_deadline
from ehp_fsm.core.transition import Rejected, step
from ehp_fsm.core.world import Instance
from tests.core.scenario import Scenario, identity

LOCAL = Path(__file__).resolve().parents[2] / "examples" / "local.toml"


@pytest.fixture
def s() -> Scenario:
    return Scenario()


def _serve(s: Scenario, eid: str, gpus: list[str], host: str) -> None:
    if s.world.globals["revision"] < 1:
        s.publish(1)
    tok = f"t-{eid}"
    s.ok("rollout_engine", eid, "launch", host=host, gpus=gpus, tp=len(gpus), token=tok)
    s.ok("rollout_engine", eid, "healthy", identity=identity(host, tok))
    s.ok("rollout_engine", eid, "installed", revision=s.world.globals["revision"])


# --- the rollout reserve and max_hybrids are guards of the core ---------------------------------


def test_an_embedding_scheduler_cannot_drain_below_the_rollout_reserve(tmp_path: Path) -> None:
    """examples/local.toml: reserve 2, three TP1 engines; one may stop, not two."""
    orch = Orchestrator.from_plan(load_plan(LOCAL), log_path=tmp_path / "t.jsonl", check=True)
    now = [1.0]

    def fire(machine: str, iid: str, name: str, **payload: object) -> object:
        now[0] += 1.0
        return orch.handle(Event(machine, iid, name, now[0], payload))

    fire("revision", "r1", "save", revision=1, step=0)
    fire("revision", "r1", "saved")
    fire("revision", "r1", "publish")
    for eid, gpu in (("e0", "h1:g0"), ("e1", "h1:g1"), ("e2", "h2:g0")):
        host = gpu.split(":")[0]
        fire("rollout_engine", eid, "launch", host=host, gpus=[gpu], tp=1, token=eid)
        fire("rollout_engine", eid, "healthy", identity=identity(host, eid))
        assert fire("rollout_engine", eid, "installed", revision=1).accepted  # type: ignore[attr-defined]
    assert fire("rollout_engine", "e0", "drain").accepted  # type: ignore[attr-defined]
    out = fire("rollout_engine", "e1", "drain")
    assert isinstance(out, Rejected)
    assert "keeps_rollout_reserve" in out.reason and "rollout reserve of 2" in out.reason
    assert orch.world.get("rollout_engine", "e1").state == "serving"  # type: ignore[union-attr]
    orch.close()


def test_the_reserve_counts_every_gpu_of_a_stopped_engine(s: Scenario) -> None:
    s.world.config["rollout_reserve"] = 2  # type: ignore[index]
    _serve(s, "e0", ["h1:g0", "h1:g1"], "h1")  # TP2
    _serve(s, "e2", ["h2:g0"], "h2")  # TP1
    reason = s.no("rollout_engine", "e0", "drain")  # 1 GPU would be left
    assert "(2 GPUs) would leave 1 GPUs serving" in reason
    s.ok("rollout_engine", "e2", "drain")  # 2 GPUs left: exactly the reserve


def test_the_reserve_is_in_the_world_config() -> None:
    config = load_plan(LOCAL).world_config()
    assert (config["rollout_reserve"], config["max_hybrids"]) == (2, 1)


def test_max_hybrids_refuses_another_allocation(s: Scenario) -> None:
    for hid in ("x0", "x1", "x2"):
        s.ok("hybrid_replica", hid, "request")
    s.ok("hybrid_replica", "x0", "allocate", host="h1", gpus=["h1:g0"])
    s.ok("hybrid_replica", "x1", "allocate", host="h1", gpus=["h1:g1"])
    reason = s.no("hybrid_replica", "x2", "allocate", host="h2", gpus=["h2:g0"])
    assert "within_max_hybrids" in reason and "max_hybrids is 2" in reason
    s.ok("hybrid_replica", "x0", "cancel", reason="planner")
    s.ok("hybrid_replica", "x2", "allocate", host="h2", gpus=["h2:g0"])


# --- a Core GPU is released only when no step holds it -------------------------------------------


def test_a_core_gpu_is_not_released_while_a_step_computes(s: Scenario) -> None:
    s.serving_engine("e0", "h1:g0")
    groups = s.completed_groups(8)
    s.ok("training_step", "s1", "begin", step=1)
    part = {"core:0": groups[:4], "core:1": groups[4:]}
    s.ok("training_step", "s1", "partition", groups=groups, partition=part)
    reason = s.no("gpu", "h0:g0", "release", owner="core")
    assert "in use by step s1" in reason
    s.ok("training_step", "s1", "delivered", replicas=["core:0", "core:1"])
    assert "in use by step s1" in s.no("gpu", "h0:g0", "release", owner="core")  # reducing
    s.ok("training_step", "s1", "reduced")
    s.ok("training_step", "s1", "stepped", version=1)  # publishing: the GPUs are idle
    s.ok("gpu", "h0:g0", "release", owner="core")


# --- ids are typed; a dispatched group is on a live engine --------------------------------------


def test_a_dispatch_naming_an_engine_by_a_non_string_id_is_refused(s: Scenario) -> None:
    _serve(s, "0", ["h1:g0"], "h1")
    s.ok("request", "g0", "enqueue")
    reason = s.no("request", "g0", "dispatch", engine=0)
    assert "payload `engine` must be an engine id (a string), got 0" in reason
    s.ok("request", "g0", "dispatch", engine="0")
    assert "payload `engine`" in s.no("request", "g0", "complete", engine=0, revision=1)
    s.reserve_engine()
    s.ok("rollout_engine", "0", "drain")  # the group is requeued: the engine can stop
    assert s.state("request", "g0") == "queued"


def test_an_event_with_a_non_string_instance_id_is_refused(s: Scenario) -> None:
    """The core refuses it (replay steps what the log holds); the embedding API does not even
    step it: a record with an int id could not be read back by replay (the log broke)."""
    event = Event("request", 7, "enqueue", 2.0)  # type: ignore[arg-type]
    out = step(s.world, event, GUARDS, EFFECTS)
    assert isinstance(out, Rejected) and "instance must be an id (a string)" in out.reason
    with pytest.raises(EventError, match=r"`instance` is 7 \(an int\), not a string"):
        s.engine.handle(event)


def test_stopping_an_installing_engine_requeues_its_groups(s: Scenario) -> None:
    """An engine that failed an update is `installing` with groups still in flight; a stop
    must requeue them (before: the engine stopped with the group dispatched to it)."""
    s.serving_engine("e0", "h1:g0")
    s.ok("request", "g0", "enqueue")
    s.ok("request", "g0", "dispatch", engine="e0")
    s.publish(2)  # e0 -> updating, g0 still in flight
    s.ok("rollout_engine", "e0", "install_failed", reason="oom")
    s.ok("rollout_engine", "e0", "stop")
    assert s.state("request", "g0") == "queued"
    s.ok("rollout_engine", "e0", "exited", identity=identity("h1", "t-e0"))


def test_invariants_require_every_dispatched_group_on_a_live_engine(s: Scenario) -> None:
    s.serving_engine("e0", "h1:g0")
    assert check_invariants(s.world) == []
    for engine in ("e9", 0):
        s.world.instances["request"]["g0"] = Instance(
            "request", "g0", "dispatched", {"engine": engine, "revision": 1}
        )
        (problem,) = check_invariants(s.world)
        assert f"dispatched to engine {engine!r}, which is unknown" in problem
    s.world.instances["request"]["g0"] = Instance(
        "request", "g0", "dispatched", {"engine": "e0", "revision": 1}
    )
    assert check_invariants(s.world) == []
    e0 = s.world.instances["rollout_engine"]["e0"]
    s.world.instances["rollout_engine"]["e0"] = Instance("rollout_engine", "e0", "stopped", e0.data)
    assert any("which is stopped" in p for p in check_invariants(s.world))


# --- reasons and untested paths ------------------------------------------------------------------


def test_all_delivered_names_duplicate_and_extra_replicas(s: Scenario) -> None:
    s.serving_engine("e0", "h1:g0")
    groups = s.completed_groups(8)
    s.ok("training_step", "s1", "begin", step=1)
    part = {"core:0": groups[:4], "core:1": groups[4:]}
    s.ok("training_step", "s1", "partition", groups=groups, partition=part)
    twice = s.no("training_step", "s1", "delivered", replicas=["core:0", "core:0", "core:1"])
    assert "deliveries from ['core:0'] are listed more than once" in twice
    extra = s.no("training_step", "s1", "delivered", replicas=["core:0", "core:1", "hybrid:x9"])
    assert "deliveries from ['hybrid:x9'], which are not in the step's partition" in extra
    assert "deliveries missing from ['core:1']" in s.no(
        "training_step", "s1", "delivered", replicas=["core:0"]
    )


def test_due_deadlines_fire_exactly_when_a_waiting_state_expires(s: Scenario) -> None:
    s.ok("hybrid_replica", "x0", "request")
    deadline = s.world.get("hybrid_replica", "x0").get("deadline")
    assert deadline == s.now + 30.0  # the plan's `requested` deadline
    assert due_deadlines(s.world, deadline - 0.5) == []
    (ev,) = due_deadlines(s.world, deadline)
    assert (ev.machine, ev.instance, ev.name, ev.time) == (
        "hybrid_replica",
        "x0",
        "deadline",
        deadline,
    )
    assert s.engine.handle(ev).accepted
    assert s.state("hybrid_replica", "x0") == "failed"
    assert due_deadlines(s.world, deadline + 100.0) == []  # terminal: nothing more fires


def test_the_timers_look_only_at_machines_that_have_a_deadline_transition(s: Scenario) -> None:
    """A `deadline` field on a machine whose spec cannot fire one (a group) neither wakes the
    shell early nor fires: those machines are not scanned on every tick."""
    s.ok("hybrid_replica", "x0", "request")
    armed = s.world.get("hybrid_replica", "x0").get("deadline")
    odd = Instance("request", "g-odd", "queued", {"deadline": 0.0})
    s.world.instances["request"]["g-odd"] = odd
    assert next_deadline(s.world) == armed
    assert due_deadlines(s.world, armed - 0.5) == []
    assert [ev.instance for ev in due_deadlines(s.world, armed)] == ["x0"]


def test_an_active_hybrid_failing_bumps_the_epoch_and_a_ready_one_does_not(s: Scenario) -> None:
    s.ready_hybrid("x0", "h1:g0")
    s.ready_hybrid("x1", "h1:g1")
    s.ok("hybrid_replica", "x0", "activate")
    assert s.world.globals["epoch"] == 1
    s.ok("hybrid_replica", "x1", "fail", reason="oom")  # never joined: membership unchanged
    assert s.world.globals["epoch"] == 1
    s.ok("hybrid_replica", "x0", "fail", reason="oom")  # a live replica left the membership
    assert s.world.globals["epoch"] == 2


def test_a_terminal_owner_owns_nothing(s: Scenario) -> None:
    s.serving_engine("e0", "h1:g0")
    s.ok("rollout_engine", "e0", "fail", reason="SIGKILL")
    s.confirm_free("h1:g0", "engine:e0")
    reason = s.no("gpu", "h1:g0", "assign", owner="engine:e0")  # e0 still lists h1:g0
    assert "owner engine:e0 is failed and can own nothing" in reason


@pytest.mark.parametrize(
    ("wanted", "granted", "ok"),
    [(3, 1, True), (3, 0, True), (2, 2, False), (1, 2, False), (3, -1, False), (True, 0, False)],
)
def test_a_shortfall_needs_wanted_above_granted(
    s: Scenario, wanted: object, granted: object, ok: bool
) -> None:
    payload = {"based_on_version": s.world.version, "wanted": wanted, "granted": granted}
    out = s.fire("capacity", "grp", "fell_short", **payload)
    assert out.accepted == ok, getattr(out, "reason", "")
    if not ok:
        assert "shortfall_given" in out.reason  # type: ignore[union-attr]
