"""The capacity machine (the planner's record, `grp`) under random events: decisions computed
from a world version that is not the current one, shortfalls that are not short (wanted <=
granted, a negative grant), events for an instance the plan did not create. Own check
(`_decisions`): an accepted decision names the world version it was accepted at, and the
record is `short` exactly when a shortfall is recorded. Plus `strategies.Harness`'s
invariants."""

from __future__ import annotations

from hypothesis import settings

from ehp_fsm.core.transition import Outcome
from ehp_fsm.core.world import Event, Instance, World
from tests.property.role_edges import check_role
from tests.property.strategies import RoleMachine


class CapacityDecisions(RoleMachine):
    FOCUS = ("capacity",)
    SUPPORT = ("gpu",)

    def setup(self) -> None:
        self.h.hooks.append(self._decisions)

    def _decisions(self, event: Event, inst: Instance | None, world: World, out: Outcome) -> None:
        grp = world.get("capacity", "grp")
        assert grp is not None
        assert (grp.state == "short") == (grp.get("shortfall") is not None)
        if out.accepted and event.machine == "capacity" and event.name != "start":
            assert event.payload["based_on_version"] == world.version - 1
            short = grp.get("shortfall")
            if short is not None:
                assert short["wanted"] > short["granted"] >= 0


CapacityDecisions.TestCase.settings = settings(
    CapacityDecisions.TestCase.settings, stateful_step_count=20
)


def test_capacity_decisions_hold_and_accept_every_edge() -> None:
    """Run in a fresh process (`role_edges.check_role`: why there), derandomized with the `ci`
    profile's examples: every invariant holds and every edge it is responsible for is
    accepted."""
    check_role(CapacityDecisions)
