"""The training_step machine under random events, illegal ones included: a step that is not
the next one or opens beside another, partitions that miss or repeat a group, use a group that
is not complete or a replica that is not live, deliveries from the wrong replica set, a
membership epoch that changed mid-step (an active Hybrid fails), a Core version that is not the
next, a publish of a revision that is not current, early deadlines, events after `done`/`failed`.
Own checks (`_groups_once`): a group is consumed by exactly the step that claimed it; a failed
step hands its groups back; a step in publishing/done consumed all its groups. Plus
`strategies.Harness`'s invariants."""

from __future__ import annotations

from hypothesis import settings
from hypothesis.stateful import rule

from ehp_fsm.core.transition import Outcome
from ehp_fsm.core.world import Event, Instance, World
from tests.property.role_edges import check_role
from tests.property.strategies import Harness, RoleMachine


class TrainingSteps(RoleMachine):
    FOCUS = ("training_step",)
    SUPPORT = ("request", "revision", "hybrid_replica")
    CASCADES = ("request",)

    def setup(self) -> None:
        self.publish("r1", 1)
        self.serve("e1", "h2", ["h2:g0"])
        for gid in ("g0", "g1", "g2", "g3"):
            self.complete_group(gid, "e1")
        self.h.hooks.append(self._groups_once)

    @rule()
    def publish_the_step(self) -> None:
        """A step in `publishing` waits for its own revision: save and publish the next one,
        then close the step (`published` is refused while the revision is the step's base)."""
        world = self.h.world
        publishing = [s.id for s in world.of("training_step").values() if s.state == "publishing"]
        if not publishing:
            return
        rev = int(world.globals.get("latest_saved") or 0) + 1
        self.publish(f"pub{rev}", rev)  # an id the random rules never touch
        self.h.fire("training_step", publishing[0], "published", {"revision": rev})

    def _groups_once(self, event: Event, inst: Instance | None, world: World, out: Outcome) -> None:
        steps = world.of("training_step")
        for r in world.of("request").values():
            if r.state == "consumed":
                s = steps.get(r.get("consumed_by"))
                assert s is not None and s.state in ("publishing", "done", "failed")
                assert r.id in s.get("groups")
            if r.state == "claimed":
                s = steps.get(r.get("claimed_by"))
                assert s is not None and s.state in ("computing", "reducing", "stepping")
        for s in steps.values():
            if s.state in ("publishing", "done"):
                for gid in s.get("groups"):
                    r = world.get("request", gid)
                    assert r is not None and r.state == "consumed"
                    assert r.get("consumed_by") == s.id


TrainingSteps.TestCase.settings = settings(TrainingSteps.TestCase.settings, stateful_step_count=30)


def test_training_steps_hold_and_accept_every_edge() -> None:
    """Run in a fresh process (`role_edges.check_role`: why there), derandomized with the `ci`
    profile's examples: every invariant holds and every edge it is responsible for is
    accepted."""
    check_role(TrainingSteps)


# --- holes found once and since closed, pinned: only its step claims and consumes a group ---


def _with_claimed_group() -> tuple[Harness, str]:
    h = Harness()
    m = TrainingSteps.__new__(TrainingSteps)
    m.h = h
    m.publish("r1", 1)
    m.serve("e1", "h2", ["h2:g0"])
    m.complete_group("g0", "e1")
    return h, "g0"


def test_claim_without_step_is_rejected_not_a_crash() -> None:
    h, gid = _with_claimed_group()
    try:
        assert not h.fire("request", gid, "claim", {}).accepted
    finally:
        h.discard()


def test_a_group_is_consumed_only_through_its_steps_optimizer_step() -> None:
    h, gid = _with_claimed_group()
    try:
        assert not h.fire("request", gid, "claim", {"step": "nobody"}).accepted
        assert not h.fire("request", gid, "consume", {"step": "nobody"}).accepted
    finally:
        h.discard()
