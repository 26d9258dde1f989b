"""The rollout_engine machine under random events, illegal ones included: launches on busy,
foreign or too few GPUs, health reports from a process with another launch token, installs of a
stale or future revision (install-before-serve), exits reported by a recycled pid (same pid,
other start time), deadlines fired early, events after `stopped`/`failed`. Revisions are
published and groups dispatched alongside, so drains and failures must requeue in-flight groups.
Invariants: `strategies.Harness`, plus the role's own checks in `_engine_rules`."""

from __future__ import annotations

from typing import Any

from hypothesis import settings

from ehp_fsm.core.transition import Outcome
from ehp_fsm.core.world import Event, Instance, World
from tests.property.role_edges import check_role
from tests.property.strategies import RoleMachine


class RolloutEngines(RoleMachine):
    FOCUS = ("rollout_engine",)
    SUPPORT = ("revision", "request", "gpu")

    def setup(self) -> None:
        self.publish("r1", 1)
        self.serve("e1", "h2", ["h2:g0"])
        self.must("request", "g0", "enqueue", prompt="p")
        self.must("request", "g0", "dispatch", engine="e1")
        self.h.hooks.append(self._engine_rules)

    def _engine_rules(
        self, event: Event, inst: Instance | None, world: World, out: Outcome
    ) -> None:
        for e in world.of("rollout_engine").values():
            if e.state == "serving":  # install-before-serve, at every instant
                assert e.get("installed") == world.globals["revision"] >= 1
        if not out.accepted or event.machine != "rollout_engine":
            return
        e = world.get("rollout_engine", event.instance)
        assert e is not None
        if event.name in ("drain", "fail", "deadline"):  # every in-flight group requeued
            left = [
                r.id
                for r in world.of("request").values()
                if r.state == "dispatched" and r.get("engine") == e.id
            ]
            assert left == [], f"{event.name} left groups {left} on engine {e.id}"
        if event.name == "launch":  # every GPU of the launch is now the engine's
            for g in e.get("gpus"):
                assert world.get("gpu", g).get("owner") == f"engine:{e.id}"  # type: ignore[union-attr]
        if e.state in ("stopped", "failed"):  # nothing it owned stays owned by it
            for g in e.get("gpus") or ():
                gpu: Any = world.get("gpu", g)
                assert gpu.state != "owned" or gpu.get("owner") != f"engine:{e.id}"


RolloutEngines.TestCase.settings = settings(
    RolloutEngines.TestCase.settings, stateful_step_count=30
)


def test_rollout_engines_hold_and_accept_every_edge() -> None:
    """Run in a fresh process (`role_edges.check_role`: why there), derandomized with the `ci`
    profile's examples: every invariant holds and every edge it is responsible for is
    accepted."""
    check_role(RolloutEngines)
