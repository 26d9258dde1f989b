"""The step function is pure, atomic across cascades, and explains every refusal."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest

from ehp_fsm import Event
from ehp_fsm.core.effects import EFFECTS
from ehp_fsm.core.guards import GUARDS
from ehp_fsm.core.invariants import check_invariants
from ehp_fsm.core.transition import Accepted, Rejected, step
from ehp_fsm.core.world import Instance
from ehp_fsm.embedded import InvariantViolation
from tests.core.scenario import Scenario

CORE = Path(__file__).resolve().parents[2] / "src" / "ehp_fsm" / "core"
FORBIDDEN = {
    "time",
    "datetime",
    "random",
    "secrets",
    "socket",
    "zmq",
    "logging",
    "structlog",
    "os",
    "subprocess",
    "threading",
    "asyncio",
    "uuid",
    "httpx",
    "torch",
}


def test_core_imports_no_clock_randomness_sockets_or_logging() -> None:
    for path in sorted(CORE.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"


def test_step_never_writes_the_world() -> None:
    s = Scenario()
    s.serving_engine("e0", "h1:g0")
    s.reserve_engine()
    before = copy.deepcopy(s.world.snapshot())
    out = step(s.world, Event("rollout_engine", "e0", "drain", 50.0), GUARDS, EFFECTS)
    assert isinstance(out, Accepted)
    assert s.world.snapshot() == before
    s.world.apply(out.changes, out.globals)
    assert s.world.get("rollout_engine", "e0").state == "draining"


def test_rejected_cascade_refuses_the_whole_step() -> None:
    s = Scenario()
    s.serving_engine("e0", "h1:g0")
    before = s.world.snapshot()
    out = s.fire("hybrid_replica", "x0", "request")
    assert isinstance(out, Accepted)
    before = s.world.snapshot()
    reason = s.no("hybrid_replica", "x0", "allocate", host="h1", gpus=["h1:g0"])
    assert "cascaded 'assign' to gpu 'h1:g0' was refused" in reason
    assert "event 'assign' is not allowed" in reason
    assert s.world.snapshot() == before


def test_refusals_name_allowed_events_and_unknowns() -> None:
    s = Scenario()
    assert "unknown machine 'toaster'" in s.no("toaster", "t", "pop")
    assert "create it with event 'launch'" in s.no("rollout_engine", "e9", "drain")
    reason = s.no("gpu", "h1:g0", "confirm_free")
    assert "in state 'free'; allowed: ['assign', 'quarantine', 'fail']" in reason
    s.serving_engine("e0", "h1:g0")
    assert "not allowed" in s.no(
        "rollout_engine", "e0", "launch", host="h1", gpus=["h1:g1"], tp=1, token="t"
    )
    # an event the machine does not have at all: named so, not "not allowed in this state"
    # (which sent the caller looking for the state in which 'Assign' would be)
    reason = s.no("gpu", "h1:g0", "Assign", owner="core")
    assert reason.startswith("gpu has no event 'Assign' (did you mean 'assign'?); its events: [")
    assert "did you mean" not in s.no("gpu", "h1:g0", "drain")
    # a launch that names no host: said so (it read "GPU h1:g1 is on host h1, not None")
    said = s.no("rollout_engine", "e8", "launch", gpus=["h1:g1"], tp=1, token="t")
    assert "payload needs the `host` its GPUs are on" in said, said


def test_refused_events_still_get_one_record() -> None:
    s = Scenario()
    out = s.fire("rollout_engine", "e0", "drain")
    assert isinstance(out, Rejected)
    (rec,) = out.records
    assert (rec.source, rec.dest, rec.accepted) == ("<new>", "<new>", False)
    assert rec.reason == out.reason


def test_cascade_records_point_at_their_cause() -> None:
    s = Scenario()
    s.serving_engine("e0", "h1:g0")
    s.ok("request", "g0", "enqueue")
    s.ok("request", "g0", "dispatch", engine="e0")
    out = s.ok("rollout_engine", "e0", "fail", reason="oom")
    kinds = [(r.machine, r.event, r.cause) for r in out.records]
    assert kinds == [
        ("rollout_engine", "fail", None),
        ("request", "abort", 0),
        ("gpu", "release", 0),
    ]


def test_same_world_and_event_give_the_same_outcome() -> None:
    a, b = Scenario(), Scenario()
    for sc in (a, b):
        sc.serving_engine("e0", "h1:g0")
    ev = Event("rollout_engine", "e0", "drain", 99.0, {}, "corr-1")
    assert step(a.world, ev, GUARDS, EFFECTS) == step(b.world, ev, GUARDS, EFFECTS)


def test_invariant_check_catches_a_corrupted_ledger() -> None:
    s = Scenario()
    s.serving_engine("e0", "h1:g0")
    assert check_invariants(s.world) == []
    gpu = s.world.get("gpu", "h1:g0")
    s.world.instances["gpu"]["h1:g0"] = Instance("gpu", "h1:g0", "free", {"host": "h1"})
    problems = check_invariants(s.world)
    assert any("engine:e0 holds GPU h1:g0, whose owner is None" in p for p in problems)
    s.world.instances["gpu"]["h1:g0"] = Instance("gpu", "h1:g0", "owned", {"host": "h1"})
    assert any("owned without an owner" in p for p in check_invariants(s.world))
    s.world.instances["gpu"]["h1:g0"] = gpu
    s.world.instances["gpu"].pop("h2:g0")
    assert any("missing from the ledger" in p for p in check_invariants(s.world))


def test_debug_mode_raises_on_an_unsound_step(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Scenario()
    s.serving_engine("e0", "h1:g0")
    # A bug in an effect: the step that fails an engine hands its GPU to no finalizer.
    monkeypatch.setitem(EFFECTS, "release_gpus", lambda act: None)
    with pytest.raises(InvariantViolation, match=r"which does not hold it \(a leak\)"):
        s.fire("rollout_engine", "e0", "fail")


def test_debug_mode_raises_on_a_world_written_behind_the_engines_back() -> None:
    """The checks follow the world event by event (`core.checks`): a world written other than
    by `handle` (here: a GPU freed under its engine) is checked whole again once it is set
    anew (`orch.world = world`), and the next accepted step is flagged, as before (when every
    step checked the whole world)."""
    s = Scenario()
    s.serving_engine("e0", "h1:g0")
    s.world.instances["gpu"]["h1:g0"] = Instance("gpu", "h1:g0", "free", {"host": "h1"})
    s.world.reindex()
    s.engine.world = s.world
    with pytest.raises(InvariantViolation, match="engine:e0 holds GPU h1:g0"):
        s.fire("request", "g0", "enqueue")


def test_a_transition_the_log_cannot_record_is_not_made(tmp_path: Path) -> None:
    # The far edge faked: a log write that fails as on a full disk. The world changed first
    # and the log missed the record, so the log no longer told what happened.
    from tests.core.scenario import Scenario

    s = Scenario(log_path=tmp_path / "t.jsonl")
    s.publish(1)
    log = s.engine.log
    assert log is not None

    def full_disk(*_: object) -> None:
        raise OSError(28, "No space left on device")

    log.write = full_disk  # type: ignore[method-assign]
    try:
        with pytest.raises(OSError, match="No space left"):
            s.fire("rollout_engine", "e0", "launch", host="h1", gpus=["h1:g0"], tp=1, token="t")
        assert s.world.get("rollout_engine", "e0") is None
        assert s.state("gpu", "h1:g0") == "free"
    finally:
        s.engine.close()
