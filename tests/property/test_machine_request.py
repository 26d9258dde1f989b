"""The request machine (one GRPO group) under random events, illegal ones included: dispatch to
an engine that is not serving or does not exist, completions from another engine or tagged with
another revision, expiry of a fresh group, events after `consumed`, unknown groups. Engines
drain, fail and update and revisions are published alongside, so groups are requeued and go
stale. Own checks (`_request_rules`): a dispatched group is on a serving, draining-free engine
or was requeued; a completed group keeps the revision its engine served. Plus
`strategies.Harness`'s invariants. (`claim`/`unclaim`/`consume` are cascade-only here, see
`strategies.CASCADE_ONLY`;
`step_holds_group` refuses them fired directly.)"""

from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import precondition, rule

from ehp_fsm.core.transition import Outcome
from ehp_fsm.core.world import Event, Instance, World
from tests.property.role_edges import check_role
from tests.property.strategies import RoleMachine


class Requests(RoleMachine):
    FOCUS = ("request",)
    SUPPORT = ("rollout_engine", "revision")

    def setup(self) -> None:
        self.publish("r1", 1)
        self.serve("e1", "h2", ["h2:g0"])
        self.serve("e2", "h2", ["h2:g1"])
        self.h.hooks.append(self._request_rules)

    @precondition(lambda self: len(self.h.world.of("revision")) < 5)
    @rule()
    def publish_next(self) -> None:
        """A training step published a newer revision: older groups drift toward stale."""
        world = self.h.world
        # above every revision so far, the ones a targeted `save` left half-made included
        taken = [int(world.globals["latest_saved"])]
        taken += [int(r.id[1:]) for r in world.of("revision").values() if r.id[1:].isdigit()]
        rev = max(taken) + 1
        self.publish(f"r{rev}", rev)

    def _request_rules(
        self, event: Event, inst: Instance | None, world: World, out: Outcome
    ) -> None:
        for r in world.of("request").values():
            if r.state == "dispatched":  # never left on an engine that drained or died
                e = world.get("rollout_engine", r.get("engine"))
                assert e is not None and e.state in ("serving", "updating", "installing")
        if out.accepted and (event.machine, event.name) == ("request", "dispatch"):
            e = world.get("rollout_engine", event.payload["engine"])
            r = world.get("request", event.instance)
            assert e is not None and r is not None and e.state == "serving"
            assert r.get("revision") == e.get("installed") == world.globals["revision"]
        if out.accepted and (event.machine, event.name) == ("request", "complete"):
            assert inst is not None
            r = world.get("request", event.instance)
            assert r is not None and r.get("revision") == inst.get("revision")


Requests.TestCase.settings = settings(Requests.TestCase.settings, stateful_step_count=30)


def test_requests_hold_and_accept_every_edge() -> None:
    """Run in a fresh process (`role_edges.check_role`: why there), derandomized with the `ci`
    profile's examples: every invariant holds and every edge it is responsible for is
    accepted."""
    check_role(Requests)
