"""The revision machine under random events, illegal ones included: saves that do not increase,
publishes of a revision not newer than the current one, retires of the current revision or of
one an engine has installed or an in-flight group was served from, events after `retired` /
`failed`. Engines and groups run alongside. Own checks (`_revision_rules`): the published
revision never decreases, and a retired revision is referenced by nothing. Plus
`strategies.Harness`'s invariants."""

from __future__ import annotations

from hypothesis import settings

from ehp_fsm.core.transition import Outcome
from ehp_fsm.core.world import Event, Instance, World
from tests.property.role_edges import check_role
from tests.property.strategies import RoleMachine


class Revisions(RoleMachine):
    FOCUS = ("revision",)
    SUPPORT = ("rollout_engine", "request")

    def setup(self) -> None:
        self.publish("r1", 1)
        self.serve("e1", "h2", ["h2:g0"])
        self.current = 1
        self.h.hooks.append(self._revision_rules)

    def _revision_rules(
        self, event: Event, inst: Instance | None, world: World, out: Outcome
    ) -> None:
        assert world.globals["revision"] >= self.current
        self.current = world.globals["revision"]
        if out.accepted and event.machine == "revision" and event.name == "retire":
            rev = world.get("revision", event.instance).get("revision")  # type: ignore[union-attr]
            assert rev != self.current
            for e in world.of("rollout_engine").values():
                assert e.state in ("stopped", "failed") or e.get("installed") != rev
            for r in world.of("request").values():
                assert r.state != "dispatched" or r.get("revision") != rev


Revisions.TestCase.settings = settings(Revisions.TestCase.settings, stateful_step_count=30)


def test_revisions_hold_and_accept_every_edge() -> None:
    """Run in a fresh process (`role_edges.check_role`: why there), derandomized with the `ci`
    profile's examples: every invariant holds and every edge it is responsible for is
    accepted."""
    check_role(Revisions)
